{{/* The chart name, or nameOverride. */}}
{{- define "specserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The release-qualified name of every object (63 characters at most, a DNS label). */}}
{{- define "specserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Labels that select the pods: never change them in an upgrade. */}}
{{- define "specserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "specserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Labels of every object. */}}
{{- define "specserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "specserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* The settings file: configFile verbatim when given (--set-file), else config as YAML. */}}
{{- define "specserve.config" -}}
{{- if .Values.configFile }}
{{- .Values.configFile }}
{{- else }}
{{- toYaml .Values.config }}
{{- end }}
{{- end }}

{{/* The model cache claim: an existing one, or the chart's own. */}}
{{- define "specserve.cacheClaim" -}}
{{- default (printf "%s-model-cache" (include "specserve.fullname" .)) .Values.modelCache.persistentVolumeClaim.existingClaim }}
{{- end }}
