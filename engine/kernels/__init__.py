"""CPU kernels of our own, compiled on first use and cached.

`bf16_linear` (cpu_linear.cpp) multiplies activation rows by a bfloat16 weight with AVX2 and
FMA, converting the weight on the fly, and `f32_linear` by a float32 weight with the same tiles:
decode and verify steps are a few rows, and their time is the weight bytes read. torch's own
bfloat16 matmuls on a CPU without native bfloat16 instructions convert through slower paths
(`python -m bench.kernels` compares them). On a CPU with AVX-512 BF16 `bf16_linear` multiplies
bfloat16 pairs directly (VDPBF16PS, no conversion of the weight); SPECSERVE_CPU_ISA=avx2 keeps
the AVX2 path there, and the start-up log names the one in use.
`quant_linear` (cpu_quant.cpp) multiplies by GGUF blocks; on a CPU with AVX-512 (`quant_isa`)
Q4_K runs one row per 16-lane register, its nibbles made floats by a 16-entry permute, at any
number of rows, and the other formats' batches of 4+ rows run two rows per register with the
same per-row arithmetic as AVX2; SPECSERVE_CPU_ISA=avx2 keeps everything on AVX2.

Batch invariance: every product here computes each activation row by the same float32
operations in the same order whatever the number of rows M, the row's place among them and the
threads' split of the work, so a request's logits do not depend on what else shares its step
(DESIGN.md, "Batch invariance"). The model takes these kernels at every M, prefill chunks
included; a BLAS GEMM (torch.mm, F.linear) chooses its blocking and summation order by the
shape, so it is not used where the kernels built. `f32_chunked_linear` and
`dequantized_chunks_linear` are such GEMMs, kept as the benchmarks' baselines.

The extension is built with torch's C++ extension tooling the first time a process needs it
(a C++ compiler and ninja; about a minute), under <cache root>/kernels/, keyed by the source,
torch's version and Python's (and apart per checkout: `build_directory`), so later starts load it
in a fraction of a second. Where it cannot
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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from engine.runtime.startup import startup_phase

logger = logging.getLogger(__name__)

_SOURCES = tuple(
    Path(__file__).with_name(name)
    for name in (
        "cpu_linear.cpp",
        "cpu_quant.cpp",
        "cpu_quant_int8.cpp",
        "cpu_layer.cpp",
        "cpu_sampling.cpp",
    )
)
_HEADERS = tuple(
    Path(__file__).with_name(name)
    for name in ("simd.h", "gguf_blocks.h", "quant_products.h", "int8_products.h")
)  # part of the build key, not compiled alone
# -ffp-contract=off: `dequantize` must round each multiply and subtract as the gguf package does.
_FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-ffp-contract=off", "-DNDEBUG"]
# Guards the one build of the extension per process.
_lock = threading.RLock()
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
                with startup_phase("CPU kernels"):  # a minute on a first start, then loaded
                    module = _build()
            except Exception as e:  # no compiler, no ninja, a failed build: torch's kernels
                reason = f"the build failed ({type(e).__name__}: {str(e)[:300]})"
        if module is None:
            logger.warning("CPU kernels unavailable, using torch's: %s", reason)
        _loaded["module"] = module
        return module


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x [rows, n].argmax(-1): by our kernel for CPU float32/bfloat16 rows where it built (torch's
    CPU argmax is a scalar loop, as slow as the rest of a decode step's sampling over a 152k
    vocabulary), by torch elsewhere. The same answer either way: the lowest index among equal
    maxima, the first NaN if any."""
    if x.device.type == "cpu" and x.dim() == 2 and x.dtype in (torch.float32, torch.bfloat16):
        module = cpu_kernels()
        if module is not None and x.shape[1] > 0:
            return module.argmax_rows(x)
    return x.argmax(dim=-1)


def build_key() -> str:
    """The extension's build key: a hash of its sources, flags, torch's and Python's versions."""
    source = b"".join(path.read_bytes() for path in (*_SOURCES, *_HEADERS))
    source += " ".join(_FLAGS).encode()
    return hashlib.sha256(
        source + torch.__version__.encode() + platform.python_version().encode()
    ).hexdigest()[:16]


def speed_signature() -> str:
    """What decides how fast the CPU kernels run here, for caches of timings: the build and the
    instruction sets in use, or that torch's kernels are used instead."""
    module = cpu_kernels()
    if module is None:
        return "torch kernels"
    return f"{build_key()} bf16:{module.cpu_isa()} gguf:{module.quant_isa()}"


def build_directory(root: Path, source_dir: Path) -> Path:
    """Where the build lives: by its key, and apart per checkout. The build's commands name the
    sources by their absolute paths, so two checkouts sharing one directory would rebuild each
    other's build at every start."""
    where = hashlib.sha256(str(source_dir.resolve()).encode()).hexdigest()[:8]
    return root / "kernels" / f"{build_key()}-{where}"


def _build() -> Any:
    from torch.utils.cpp_extension import load

    from engine.runtime.cache import cache_root

    key = build_key()
    build_dir = build_directory(cache_root(), _SOURCES[0].parent)
    build_dir.mkdir(parents=True, exist_ok=True)
    name = f"specserve_cpu_kernels_{key}"
    if not (build_dir / f"{name}.so").exists():
        logger.info("building the CPU kernels in %s (about a minute, once)", build_dir)
    start = time.perf_counter()
    # torch's builder marks a build in progress with a plain `lock` file that a killed process
    # leaves behind, and then every later start waits on it forever. Builds are serialised here
    # by an OS lock instead, which dies with its holder; whoever holds it may clear that file.
    with open(build_dir.with_suffix(".lock"), "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        (build_dir / "lock").unlink(missing_ok=True)
        module = load(
            name=name,
            sources=[str(path) for path in _SOURCES],
            extra_cflags=_FLAGS,
            build_directory=str(build_dir),
            verbose=False,
        )
    logger.info(
        "CPU kernels ready in %.1f s (%s; bfloat16 linear: %s; GGUF linear batches: %s)",
        time.perf_counter() - start,
        build_dir,
        module.cpu_isa(),
        module.quant_isa(),
    )
    return module


# Weight rows converted to float32 at a time by `f32_chunked_linear`: a few MiB, so a chunk is
# still in cache when the GEMM reads it.
_CHUNK_BYTES = 4 << 20


def f32_chunked_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T (+ bias) in float32 GEMMs over float32 copies of a few weight
    rows at a time, the result in x's dtype: the BLAS's float32 GEMM, far faster than bfloat16
    on CPUs without native bfloat16 arithmetic, but not batch-invariant (a benchmark baseline;
    the model uses `bf16_linear`)."""
    return _chunked_float32_gemm(
        x, weight.shape[0], lambda n0, n1: weight[n0:n1].float(), bias, x.dtype
    )


def _chunked_float32_gemm(
    x: torch.Tensor,
    num_out: int,
    rows: Any,
    bias: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """x [M, K] @ W.T (+ bias) in float32 GEMMs, the result in `dtype`; W's rows [n0, n1) are
    given as float32 by rows(n0, n1) a few MiB at a time (still in cache when the GEMM reads
    them)."""
    xf = x.float()
    out = torch.empty(x.shape[0], num_out, dtype=dtype, device=x.device)
    chunk = max(16, _CHUNK_BYTES // (4 * x.shape[1]))
    for n0 in range(0, num_out, chunk):
        n1 = min(num_out, n0 + chunk)
        part = torch.mm(xf, rows(n0, n1).t())
        if bias is not None:
            part += bias[n0:n1]
        out[:, n0:n1] = part
    return out


# ---------------------------------------------------------------------------- GGUF blocks


def dequantized_chunks_linear(x: torch.Tensor, blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """x [M, K] @ W.T in float32 GEMMs, W dequantised (exactly) a few MiB of rows at a time: for
    many rows the BLAS's GEMM outruns a kernel that decodes every block for each tile of rows,
    but it is not batch-invariant (a benchmark baseline; the model uses `quant_linear`)."""
    module, num_in = _loaded["module"], x.shape[1]
    return _chunked_float32_gemm(
        x, blocks.shape[0], lambda n0, n1: module.dequantize(blocks[n0:n1], qtype, num_in)
    )


def quant_linear(
    x: torch.Tensor,
    blocks: Sequence[torch.Tensor],
    qtypes: Sequence[int],
    bias: torch.Tensor | None = None,
    int8: bool = False,
) -> torch.Tensor:
    """x [M, K] @ W.T (+ bias) in float32 for a GGUF-quantised W (engine.models.gguf) whose rows
    are the runs blocks[0], blocks[1], ... of GGML types qtypes[i], by our kernel at any M (each
    row's result the same whatever M). With `int8`, the runs whose format has an int8-activation
    product (`int8_supported`: the K-quants Q4_K and Q6_K) multiply x quantised to int8
    (`quantize_activations`), and the others as without. Needs `cpu_kernels()`."""
    if int8:
        return _int8_linear(x, blocks, qtypes, bias)
    return _loaded["module"].quant_linear_parts(x, list(blocks), list(qtypes), bias)


def int8_supported(qtype: int, columns: int) -> bool:
    """Whether GGML type `qtype` over `columns` columns has an int8-activation product."""
    return bool(_loaded["module"].int8_supported(qtype, columns))


def _int8_linear(
    x: torch.Tensor,
    blocks: Sequence[torch.Tensor],
    qtypes: Sequence[int],
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """quant_linear with int8 activations where the format has them: one kernel call for all the
    runs that do (the activations are quantised once), the float32 product for the others."""
    module, columns = _loaded["module"], x.shape[1]
    supported = [int8_supported(qtype, columns) for qtype in qtypes]
    if all(supported):
        return module.quant_linear_int8(x, list(blocks), list(qtypes), bias)
    if not any(supported):
        return quant_linear(x, blocks, qtypes, bias)
    outs = [
        quant_linear(x, [part], [qtype], int8=ok)
        for part, qtype, ok in zip(blocks, qtypes, supported, strict=True)
    ]
    out = torch.cat(outs, dim=1)
    if bias is not None:
        out += bias
    return out


INT8_BLOCK = 256  # activations per int8 scale


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] (K a multiple of INT8_BLOCK) as the int8-activation products see it, in float32:
    each block of INT8_BLOCK columns of a row is d * q, d = max|x| / 127, q = round(x / d) (to
    nearest, ties to even) in [-127, 127] — the kernel's quantisation, value for value. The
    products equal x's quantised values times the dequantised weights, up to float32 summation
    order: the reference the tests hold the kernel to."""
    rows, columns = x.shape
    blocks = x.float().reshape(rows, columns // INT8_BLOCK, INT8_BLOCK)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    inverse = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inverse).clamp(-127, 127)
    return (q * (amax / 127)).reshape(rows, columns)
