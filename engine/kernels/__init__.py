"""CPU kernels of our own, compiled on first use and cached.

`bf16_linear` (cpu_linear.cpp) multiplies a few activation rows by a bfloat16 weight with AVX2
and FMA, converting the weight on the fly: decode and verify steps are these shapes, and their
time is the weight bytes read. torch's own bfloat16 matmuls on a CPU without native bfloat16
instructions convert through slower paths (`python bench/kernels.py` compares them).

The extension is built with torch's C++ extension tooling the first time a process needs it
(a C++ compiler and ninja; about a minute), under <cache root>/kernels/, keyed by the source,
torch's version and Python's, so later starts load it in a fraction of a second. Where it cannot
be had — not x86-64, no AVX2/FMA, no compiler, SPECSERVE_CPU_KERNELS=0 — `cpu_kernels()` is
None and the model uses torch's kernels; the reason is logged once.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
import time
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_linear.cpp")
_FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-DNDEBUG"]
_lock = threading.Lock()
_loaded: dict[str, Any] = {}


def unavailable_reason() -> str | None:
    """Why the CPU kernels cannot run here, or None if they can."""
    if os.environ.get("SPECSERVE_CPU_KERNELS", "1") == "0":
        return "turned off by SPECSERVE_CPU_KERNELS=0"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"they need x86-64 (this is {platform.machine()})"
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return f"they need AVX2 and FMA (torch reports {torch.backends.cpu.get_cpu_capability()})"
    return None


def cpu_kernels() -> Any | None:
    """The compiled extension module, building it on first use; None where it cannot be had."""
    if "module" in _loaded:  # every linear of every step asks: no lock once decided
        return _loaded["module"]
    with _lock:
        if "module" in _loaded:
            return _loaded["module"]
        module = None
        reason = unavailable_reason()
        if reason is None:
            try:
                module = _build()
            except Exception as e:  # no compiler, no ninja, a failed build: torch's kernels
                reason = f"the build failed ({type(e).__name__}: {str(e)[:300]})"
        if module is None:
            logger.warning("CPU kernels unavailable, using torch's: %s", reason)
        _loaded["module"] = module
        return module


def _build() -> Any:
    from torch.utils.cpp_extension import load

    from engine.models.bundled import cache_root

    source = _SOURCE.read_bytes()
    key = hashlib.sha256(
        source + torch.__version__.encode() + platform.python_version().encode()
    ).hexdigest()[:16]
    build_dir = cache_root() / "kernels" / key
    build_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    module = load(
        name=f"specserve_cpu_kernels_{key}",
        sources=[str(_SOURCE)],
        extra_cflags=_FLAGS,
        build_directory=str(build_dir),
        verbose=False,
    )
    logger.info("CPU kernels ready in %.1f s (%s)", time.perf_counter() - start, build_dir)
    return module
