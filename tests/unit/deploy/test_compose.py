"""Compose and Prometheus: the base file, the CPU override and their merge (Compose's merge rules,
`!reset` included) validated against the Compose Specification schema vendored in
deploy/schemas/, the services and their configs, and the Prometheus config wired to them."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.unit.deploy.helpers import (
    CONFIGS,
    CPU_CONFIGS,
    DASHBOARD,
    DEPLOY,
    GPU_PRESETS,
    ROOT,
    dockerfile_settings,
    healthcheck_code,
    runtime_instruction,
)

jsonschema = pytest.importorskip("jsonschema")


class _Reset:
    """`!reset`: the key disappears from the merged model."""


RESET = _Reset()


class _Override:
    """`!override VALUE`: VALUE replaces the base file's value instead of merging with it."""

    def __init__(self, value: Any) -> None:
        self.value = value


class _ComposeLoader(yaml.SafeLoader):
    pass


_ComposeLoader.add_constructor("!reset", lambda loader, node: RESET)
_ComposeLoader.add_constructor(
    "!override", lambda loader, node: _Override(_construct(loader, node))
)


def _construct(loader: yaml.SafeLoader, node: yaml.Node) -> Any:
    if isinstance(node, yaml.MappingNode):
        return loader.construct_mapping(node, deep=True)
    if isinstance(node, yaml.SequenceNode):
        return loader.construct_sequence(node, deep=True)
    return loader.construct_scalar(node)


# Compose merges sequences by appending, except these, which the later file replaces.
_REPLACED_SEQUENCES = frozenset({"command", "entrypoint", "test"})


def _merge(base: Any, override: Any, key: str = "") -> Any:
    """Compose's merge of an override file into a base file (its documented rules)."""
    if isinstance(override, _Override):
        return override.value
    if isinstance(base, dict) and isinstance(override, dict):
        merged = dict(base)
        for k, value in override.items():
            if value is RESET:
                merged.pop(k, None)
            else:
                merged[k] = _merge(merged[k], value, k) if k in merged else _merge(None, value, k)
        return merged
    if isinstance(base, list) and isinstance(override, list) and key not in _REPLACED_SEQUENCES:
        return base + [item for item in override if item not in base]
    if isinstance(override, dict):  # a new mapping may still carry tags
        return {k: _merge(None, v, k) for k, v in override.items() if v is not RESET}
    return override


def _interpolate(value: Any) -> Any:
    """${VAR:-default} and ${VAR} as Compose resolves them with none of the variables set."""
    if isinstance(value, dict):
        return {k: _interpolate(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(v) for v in value]
    if isinstance(value, str):
        return re.sub(r"\$\{\w+(?::?-([^}]*))?\}", lambda m: m.group(1) or "", value)
    return value


def _compose(name: str) -> Any:
    return yaml.load((ROOT / name).read_text(), Loader=_ComposeLoader)


@pytest.fixture(scope="module")
def compose_validator() -> Any:
    schema = json.loads((DEPLOY / "schemas" / "compose-spec.json").read_text())
    validator_cls = jsonschema.validators.validator_for(schema)
    validator_cls.check_schema(schema)
    return validator_cls(schema)


def _assert_valid(validator: Any, document: Any) -> None:
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(document)]
    assert not errors, errors


@pytest.fixture(scope="module")
def compose_models() -> dict[str, Any]:
    base = _interpolate(_compose("docker-compose.yml"))
    cpu = _compose("docker-compose.cpu.yml")
    return {"gpu": base, "cpu": _interpolate(_merge(base, cpu)), "override": _merge(None, cpu)}


def test_compose_files_match_the_schema(compose_validator, compose_models):
    for model in compose_models.values():
        _assert_valid(compose_validator, model)
    bad = {"services": {"specserve": {"deploy": {"resources": {"reservations": {"gpus": 1}}}}}}
    assert list(compose_validator.iter_errors(bad)), "the schema rejects unknown keys"


def test_compose_gpu_and_cpu_services(compose_models):
    gpu = compose_models["gpu"]["services"]["specserve"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert (ROOT / gpu["build"]["dockerfile"]).name == "Dockerfile"
    cpu = compose_models["cpu"]["services"]["specserve"]
    assert "deploy" not in cpu, "the CPU override drops the GPU reservation"
    assert cpu["build"] == {"context": ".", "dockerfile": "Dockerfile.cpu"}
    assert cpu["image"] != gpu["image"]
    assert {k: v for k, v in cpu.items() if k not in ("build", "image")} == {
        k: v for k, v in gpu.items() if k not in ("build", "image", "deploy")
    }


def _compose_config(service: dict[str, Any]) -> Path:
    """The configs/ file a compose service serves: its command's, else its image's CMD's."""
    args = service.get("command") or json.loads(
        runtime_instruction(ROOT / service["build"]["dockerfile"], "CMD")
    )
    return CONFIGS / args[args.index("--config") + 1].removeprefix("/app/configs/")


def test_compose_services_serve_configs_for_their_hardware(compose_models):
    assert _compose_config(compose_models["gpu"]["services"]["specserve"]) in GPU_PRESETS
    assert _compose_config(compose_models["cpu"]["services"]["specserve"]) in CPU_CONFIGS


def test_compose_wiring(compose_models):
    services = compose_models["gpu"]["services"]
    specserve = services["specserve"]
    env = dockerfile_settings(ROOT / "Dockerfile", "ENV")
    assert f"model-cache:{env['SPECSERVE_CACHE']}" in specserve["volumes"]
    assert specserve["ports"] == [f"8000:{env['SPECSERVE_PORT']}"]
    health = specserve["healthcheck"]["test"]
    assert health == ["CMD", "python", "-c", healthcheck_code(ROOT / "Dockerfile")]
    assert set(compose_models["gpu"]["volumes"]) >= {"model-cache", "prometheus-data"}
    for service in ("prometheus", "grafana"):
        for mount in services[service]["volumes"]:
            source = mount.split(":")[0]
            if source.startswith("./"):
                assert (ROOT / source).exists(), mount
    scrape = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    (job,) = scrape["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"] == [f"specserve:{env['SPECSERVE_PORT']}"]


def test_promtool_accepts_the_prometheus_config():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian package prometheus)")
    result = subprocess.run(
        [promtool, "check", "config", str(DEPLOY / "prometheus" / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_grafana_provisioning_points_at_compose():
    provisioning = DEPLOY / "grafana" / "provisioning"
    (source,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())[
        "datasources"
    ]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "specserve.yml").read_text())[
        "providers"
    ]
    grafana = _interpolate(_compose("docker-compose.yml"))["services"]["grafana"]
    assert f"./deploy/grafana/dashboards:{provider['options']['path']}:ro" in grafana["volumes"]
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{provider['options']['path']}/{DASHBOARD.name}"
