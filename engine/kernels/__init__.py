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

import fcntl
import hashlib
import logging
import os
import platform
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

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
    # torch's builder marks a build in progress with a plain `lock` file that a killed process
    # leaves behind, and then every later start waits on it forever. Builds are serialised here
    # by an OS lock instead, which dies with its holder; whoever holds it may clear that file.
    with open(build_dir.with_suffix(".lock"), "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        (build_dir / "lock").unlink(missing_ok=True)
        module = load(
            name=f"specserve_cpu_kernels_{key}",
            sources=[str(_SOURCE)],
            extra_cflags=_FLAGS,
            build_directory=str(build_dir),
            verbose=False,
        )
    logger.info("CPU kernels ready in %.1f s (%s)", time.perf_counter() - start, build_dir)
    return module


# Up to this many activation rows the kernel always wins (decode and verify steps stream the
# weights; torch's bfloat16 matmuls convert through slower paths). Past it, which is faster at
# prefill sizes depends on the CPU (its bfloat16 support, oneDNN's paths), so it is measured.
ALWAYS_ROWS = 16
_PROBE_ROWS = 64


def max_kernel_rows(weight: torch.Tensor) -> int:
    """The most activation rows to send to the kernel: ALWAYS_ROWS, or no limit when the kernel
    also beats torch's F.linear at _PROBE_ROWS rows on this weight. Measured once per process on
    the first weight asked about (a few milliseconds), logged, then reused."""
    limit = _loaded.get("max_rows")
    if limit is not None:
        return int(limit)
    module = cpu_kernels()
    assert module is not None
    x = torch.randn(_PROBE_ROWS, weight.shape[1], dtype=weight.dtype, device="cpu")
    ours = _best_seconds(lambda: module.bf16_linear(x, weight, None))
    theirs = _best_seconds(lambda: F.linear(x, weight))
    limit = 1 << 62 if ours < theirs else ALWAYS_ROWS
    logger.info(
        "bfloat16 linear over %d rows: ours %.2f ms, torch %.2f ms -> ours %s",
        _PROBE_ROWS,
        ours * 1e3,
        theirs * 1e3,
        "at every size" if ours < theirs else f"up to {ALWAYS_ROWS} rows",
    )
    _loaded["max_rows"] = limit
    return limit


def _best_seconds(fn: Any, repeats: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best
