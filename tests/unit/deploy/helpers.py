"""What the deployment checks share: the paths of the deployment artifacts and configs, and the
PromQL the dashboard and the Prometheus adapter name (also read by
tests/e2e/test_dashboard_metrics.py, which checks the same names on a live /metrics)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from engine.config import EngineConfig

promql = pytest.importorskip("promql_parser")


ROOT = Path(__file__).resolve().parents[3]
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "specserve.json"
CONFIGS = ROOT / "configs"
GPU_PRESETS = sorted(CONFIGS.glob("gpu-*.yaml"))
CPU_CONFIGS = sorted(set(CONFIGS.glob("*.yaml")) - set(GPU_PRESETS))
GPU_IMAGE_CONFIG = CONFIGS / "gpu-qwen2.5-coder-1.5b.yaml"


def grafana_free(expr: str) -> str:
    """The expression with Grafana's variables replaced by values PromQL can parse."""
    for variable, value in (("$__rate_interval", "1m"), ("$__interval", "1m")):
        expr = expr.replace(variable, value)
    return re.sub(r"\$\{?(\w+)\}?", "x", expr)


def promql_selectors(expr: str) -> list[tuple[str, dict[str, str]]]:
    """(metric name, {label: matched value}) of every selector in a PromQL expression."""
    found: list[tuple[str, dict[str, str]]] = []

    def visit(node: Any) -> None:
        if isinstance(node, promql.VectorSelector):
            matchers = node.matchers.matchers if node.matchers else []
            found.append((node.name, {m.name: m.value for m in matchers}))

    promql.walk(promql.parse(grafana_free(expr)), visit)
    return found


def dashboard_exprs() -> list[str]:
    """Every PromQL expression of the dashboard: panel targets and template variable queries."""
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        query = variable.get("query")
        if isinstance(query, dict):
            match = re.fullmatch(r"label_values\((.+),\s*\w+\)", query["query"])
            exprs.append(match.group(1) if match else query["query"])
    return exprs


def adapter_rules() -> list[dict[str, Any]]:
    values = yaml.safe_load((DEPLOY / "helm" / "prometheus-adapter-values.yaml").read_text())
    return values["rules"]["custom"]


def deployment_metric_names() -> set[str]:
    """Every series name the dashboard and the autoscaling rules query."""
    exprs = dashboard_exprs() + [rule["seriesQuery"] for rule in adapter_rules()]
    return {name for expr in exprs for name, _ in promql_selectors(expr)}


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) per instruction, continuation lines joined, comments dropped."""
    lines = [ln for ln in path.read_text().splitlines() if not ln.lstrip().startswith("#")]
    text = re.sub(r"\\\n", " ", "\n".join(lines))
    found = []
    for line in text.splitlines():
        if line.strip():
            keyword, _, args = line.strip().partition(" ")
            found.append((keyword.upper(), args.strip()))
    return found


def dockerfile_stages(path: Path) -> list[list[tuple[str, str]]]:
    stages: list[list[tuple[str, str]]] = []
    for keyword, args in dockerfile_instructions(path):
        if keyword == "FROM":
            stages.append([])
        if stages:
            stages[-1].append((keyword, args))
    return stages


def dockerfile_settings(path: Path, keyword: str) -> dict[str, str]:
    """ENV or ARG settings of a whole Dockerfile (the last one of a name wins)."""
    values = {}
    for kw, args in dockerfile_instructions(path):
        if kw == keyword:
            for item in shlex.split(args):
                name, _, value = item.partition("=")
                values[name] = value
    return values


def runtime_instruction(path: Path, keyword: str) -> str:
    matches = [args for kw, args in dockerfile_stages(path)[-1] if kw == keyword]
    assert matches, f"{path.name}: the runtime stage has no {keyword}"
    return matches[-1]


def healthcheck_code(dockerfile: Path) -> str:
    args = runtime_instruction(dockerfile, "HEALTHCHECK")
    command = json.loads(args[args.index("CMD") + 3 :].strip())
    assert command[:2] == ["python", "-c"]
    return command[2]


def assert_gpu_preset(config: EngineConfig) -> None:
    """What flash-attn 2 runs: CUDA, bfloat16, pages of 256 tokens; plus the preset's policy."""
    resolved = (config.device, config.attention_backend, config.block_size, config.dtype)
    assert resolved == ("cuda", "flash_attn", 256, "bfloat16")
    assert config.gpu_memory_utilization == 0.9 and config.enforce_eager is False
    spec = config.speculative_config
    assert spec is not None and spec.methods == ("ngram", "draft_model") and spec.mode == "auto"
    assert 3 <= spec.num_speculative_tokens <= 8
