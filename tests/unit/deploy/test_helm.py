"""The Helm chart, rendered without a cluster: helm lint, every variant's manifests against the
Kubernetes schemas, GPU and CPU resources, probes and ports, the ServiceMonitor and autoscaler,
and the config each variant passes the server."""

from __future__ import annotations

import platform
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from server.settings import load_settings
from tests.metric_schema import EXPORTED
from tests.unit.deploy.helpers import (
    DEPLOY,
    GPU_IMAGE_CONFIG,
    ROOT,
    adapter_rules,
    assert_gpu_preset,
    promql_selectors,
)
from tests.unit.test_config import cpu_node, fake_cuda_node

kubernetes_validate = pytest.importorskip("kubernetes_validate")


# helm-python-sdk ships its native library for x86_64 Linux (the CI machine): required there.
if platform.system() == "Linux" and platform.machine() == "x86_64":
    import helm_python as helm
else:
    helm = pytest.importorskip("helm_python")


CHART = DEPLOY / "helm" / "specserve"
KUBERNETES_VERSION = "1.30.0"


def _render(values: dict[str, Any] | None = None) -> dict[str, list[dict[str, Any]]]:
    """Manifests by kind, from Helm's own template engine (no cluster contacted)."""
    with helm.Chart.load(str(CHART)) as chart:
        rendered = chart.render(values, name="demo", namespace="ml")
    manifests: dict[str, list[dict[str, Any]]] = {}
    for path, text in rendered.items():
        if path.endswith(".yaml"):
            for doc in yaml.safe_load_all(text):
                if doc:
                    manifests.setdefault(doc["kind"], []).append(doc)
    return manifests


def _cpu_values() -> dict[str, Any]:
    return yaml.safe_load((CHART / "values-cpu.yaml").read_text())


ALL_OPTIONS = {
    "serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
    "autoscaling": {"enabled": True},
    "modelCache": {"persistentVolumeClaim": {"enabled": True, "storageClassName": "fast"}},
    "apiKey": {"existingSecret": "specserve-api-key"},
    "runtimeClassName": "nvidia",
    "extraArgs": ["--max-num-seqs", "8"],
    "env": [{"name": "SPECSERVE_LOG_LEVEL", "value": "debug"}],
    "extraVolumes": [
        {"name": "models", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}}
    ],
    "extraVolumeMounts": [{"name": "models", "mountPath": "/models", "readOnly": True}],
}


VARIANTS = {"gpu": None, "cpu": "cpu", "all-options": ALL_OPTIONS}


def _variant(name: str) -> dict[str, Any] | None:
    values = VARIANTS[name]
    return _cpu_values() if values == "cpu" else values


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_helm_lint_is_clean(variant):
    report = helm.lint(str(CHART), _variant(variant), strict=True)
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not report["errors"] and not problems, report


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_helm_manifests_match_kubernetes_schemas(variant):
    manifests = _render(_variant(variant))
    expected = {"ConfigMap", "Deployment", "Service"}
    if variant == "all-options":
        expected |= {"ServiceMonitor", "HorizontalPodAutoscaler", "PersistentVolumeClaim"}
    assert set(manifests) == expected
    for kind, docs in manifests.items():
        if kind == "ServiceMonitor":  # a CRD: its wiring is checked below
            continue
        for doc in docs:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_helm_validation_is_not_blind():
    (deployment,) = _render()["Deployment"]
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGett"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


def _container(manifests: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    (deployment,) = manifests["Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def test_helm_gpu_and_cpu_resources():
    gpu = _container(_render())
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert gpu["image"] == "specserve:gpu"
    cpu_manifests = _render(_cpu_values())
    cpu = _container(cpu_manifests)
    assert not any("nvidia" in key for part in cpu["resources"].values() for key in part)
    assert cpu["image"] == "specserve:cpu"
    assert "tolerations" not in cpu_manifests["Deployment"][0]["spec"]["template"]["spec"]


def test_helm_probes_and_ports():
    manifests = _render(ALL_OPTIONS)
    container = _container(manifests)
    port_names = {p["name"]: p["containerPort"] for p in container["ports"]}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["SPECSERVE_HOST"] == "0.0.0.0" and int(env["SPECSERVE_PORT"]) == port_names["http"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert env["SPECSERVE_CACHE"] == mounts["model-cache"]
    assert mounts["models"] == "/models"
    (deployment,) = manifests["Deployment"]
    volumes = {v["name"] for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert set(mounts) <= volumes
    assert container["args"][:2] == ["--config", f"{mounts['config']}/config.yaml"]
    assert container["args"][2:] == ["--max-num-seqs", "8"]
    (service,) = manifests["Service"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    assert "replicas" not in deployment["spec"], "the HPA owns the replica count"


def test_helm_service_monitor_and_autoscaler():
    manifests = _render(ALL_OPTIONS)
    (monitor,) = manifests["ServiceMonitor"]
    (service,) = manifests["Service"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"
    (hpa,) = manifests["HorizontalPodAutoscaler"]
    (deployment,) = manifests["Deployment"]
    assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    (rule,) = adapter_rules()
    ((series, _),) = promql_selectors(rule["seriesQuery"])
    assert series == "specserve:num_requests_waiting" and series in EXPORTED
    served = re.sub(rule["name"]["matches"], rule["name"]["as"].replace("${1}", r"\1"), series)
    assert metric["pods"]["metric"]["name"] == served


def _config_settings(manifests: dict[str, list[dict[str, Any]]], tmp_path: Path) -> Any:
    (config_map,) = manifests["ConfigMap"]
    path = tmp_path / "config.yaml"
    path.write_text(config_map["data"]["config.yaml"])
    env = {e["name"]: e["value"] for e in _container(manifests)["env"] if "value" in e}
    return load_settings(path, environ=env)


def test_helm_config_is_the_gpu_image_preset(tmp_path, monkeypatch):
    manifests = _render()
    (config_map,) = manifests["ConfigMap"]
    preset = yaml.safe_load(GPU_IMAGE_CONFIG.read_text())
    assert yaml.safe_load(config_map["data"]["config.yaml"]) == {"engine": preset["engine"]}
    settings = _config_settings(manifests, tmp_path)
    assert settings.host == "0.0.0.0"
    fake_cuda_node(monkeypatch)
    config = settings.engine_config()
    assert_gpu_preset(config)
    assert config.speculative_config.num_speculative_tokens == 5


def test_helm_cpu_config_is_configs_default(tmp_path, monkeypatch):
    manifests = _render(_cpu_values())
    (config_map,) = manifests["ConfigMap"]
    default = yaml.safe_load((ROOT / "configs" / "default.yaml").read_text())
    assert yaml.safe_load(config_map["data"]["config.yaml"]) == {"engine": default["engine"]}
    cpu_node(monkeypatch)
    config = _config_settings(manifests, tmp_path).engine_config()
    assert (config.device, config.attention_backend, config.block_size) == ("cpu", "cpu", 16)


def test_helm_config_file_is_passed_verbatim():
    text = (ROOT / "configs" / "smollm2-cpu.yaml").read_text()
    (config_map,) = _render({"configFile": text})["ConfigMap"]
    assert config_map["data"]["config.yaml"].strip() == text.strip()
