"""What the node is, read before any check runs: driver, CUDA, torch, the GPU, which attention
backends import, NVML, and whether the project's own dependencies import. `problems` names what
stops the smoke at once (no CUDA device where one is required, a dependency missing), so a bad
node fails in seconds instead of in the middle of the checks."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

# Modules of the project's dependencies that the bare GPU machine's image lacks (they travel as
# wheels: deploy/gpu_wheels.py) and the GPU checks import; torch and transformers are the image's.
PROJECT_MODULES = (
    "torch",
    "transformers",
    "safetensors",
    "pydantic",
    "fastapi",
    "uvicorn",
    "xgrammar",
    "gguf",
    "yaml",
    "openai",
    "jsonschema",
)
# Attention kernels' packages: (import name, distribution name).
KERNEL_PACKAGES = (("flash_attn", "flash-attn"), ("triton", "triton"))


@dataclass(frozen=True)
class NodeEnvironment:
    """The facts the smoke prints first and writes into its JSON."""

    python: str
    torch: str
    cuda: str | None  # the CUDA torch was built with
    driver: str | None
    device: str  # what the checks and the bench run on: "cuda" or "cpu" (a dry run)
    gpu: dict[str, Any] | None  # name, capability, memory_gib, multiprocessors
    kernels: dict[str, str]  # flash_attn / triton -> version or why it does not import
    backends: dict[str, str]  # the engine's registry: name -> "available" or why not
    auto_backend: str  # what attention_backend auto picks here for bfloat16 (float32 on CPU)
    nvml: str
    missing_modules: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        gpu = self.gpu or {}
        described = (
            f"{gpu['name']} (compute capability {gpu['capability']}, {gpu['memory_gib']} GiB, "
            f"{gpu['multiprocessors']} SMs)"
            if gpu
            else "none"
        )
        return [
            f"device      {self.device}; GPU {described}",
            f"versions    python {self.python}, torch {self.torch}, CUDA {self.cuda or 'none'}, "
            f"driver {self.driver or 'unknown'}",
            "kernels     " + ", ".join(f"{k} {v}" for k, v in self.kernels.items()),
            "backends    " + ", ".join(f"{k}: {v}" for k, v in self.backends.items()),
            f"auto        attention_backend auto -> {self.auto_backend}",
            f"nvml        {self.nvml}",
            f"modules     {'all import' if not self.missing_modules else 'MISSING ' + ', '.join(self.missing_modules)}",
        ]

    def problems(self) -> list[str]:
        """Why the smoke cannot go on here (empty: it can)."""
        found = []
        if self.device.startswith("cuda") and self.gpu is None:
            found.append(
                f"no CUDA device: torch {self.torch} (CUDA {self.cuda or 'none'}) sees none; "
                "SPECSERVE_GPU_TESTS_DEVICE=cpu (or --dry-run) runs the smoke on the CPU"
            )
        if self.missing_modules:
            found.append(
                f"modules do not import: {', '.join(self.missing_modules)} (a bare node needs "
                "the wheels of `make gpu-wheels`, carried as .gpu-wheels/)"
            )
        return found


def missing_modules(names: tuple[str, ...] = PROJECT_MODULES) -> list[str]:
    """The modules that cannot be found (found by spec, not imported: nothing is cached)."""
    importlib.invalidate_caches()
    return [name for name in names if importlib.util.find_spec(name) is None]


def probe(device: str) -> NodeEnvironment:
    import torch

    missing = missing_modules()
    gpu = _gpu() if device.startswith("cuda") and torch.cuda.is_available() else None
    backends, auto = _engine_backends(device) if not missing else ({}, "unknown")
    return NodeEnvironment(
        python=sys.version.split()[0],
        torch=torch.__version__,
        cuda=torch.version.cuda,
        driver=_driver_version(),
        device=device,
        gpu=gpu,
        kernels={name: _kernel_version(name, dist) for name, dist in KERNEL_PACKAGES},
        backends=backends,
        auto_backend=auto,
        nvml=_nvml(),
        missing_modules=missing,
    )


def _gpu() -> dict[str, Any]:
    import torch

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {
        "name": props.name,
        "capability": f"{props.major}.{props.minor}",
        "memory_gib": round(props.total_memory / 2**30, 1),
        "multiprocessors": props.multi_processor_count,
    }


def _kernel_version(module: str, dist: str) -> str:
    """Its version if it imports; why not otherwise (a broken ABI shows here, not as a skip)."""
    try:
        importlib.import_module(module)
    except Exception as e:  # ImportError, or an extension built for another torch
        return f"does not import ({type(e).__name__}: {str(e)[:120]})"
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "imports (version unknown)"


def _engine_backends(device: str) -> tuple[dict[str, str], str]:
    """The engine's registry (the Triton backend shows up here once it is registered) and what
    auto resolves to on this device."""
    from engine.attention import BACKENDS, resolve_attention_backend

    device_type = "cuda" if device.startswith("cuda") else "cpu"
    found = {}
    for name, spec in BACKENDS.items():
        if not spec.supports_device(device_type):
            found[name] = f"not for {device_type}"
        else:
            found[name] = "available" if spec.is_available() else "unavailable"
    if "triton" not in BACKENDS:
        found["triton"] = "not registered in engine.attention.BACKENDS"
    dtype = "bfloat16" if device_type == "cuda" else "float32"
    try:
        auto = resolve_attention_backend("auto", device_type, {"dtype": dtype}).name
    except ValueError as e:
        auto = f"none ({e})"
    return found, f"{auto} ({dtype})"


def _driver_version() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        return str(pynvml.nvmlSystemGetDriverVersion())
    except Exception:
        pass
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        result = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (
        result.stdout.strip().splitlines()[0] if result.returncode == 0 and result.stdout else None
    )


def _nvml() -> str:
    """NVML's state: it may be absent (no nvidia-ml-py, MIG, containers) without failing."""
    try:
        import pynvml
    except ImportError:
        return "absent (nvidia-ml-py not installed)"
    try:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        pynvml.nvmlDeviceGetUtilizationRates(handle)
    except Exception as e:
        return f"present but unusable ({type(e).__name__}: {str(e)[:120]})"
    return f"available ({pynvml.nvmlDeviceGetCount()} device(s))"
