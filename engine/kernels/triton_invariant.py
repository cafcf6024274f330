"""The GPU's batch-invariant mode (`batch_invariant: true`): the products and norms of a forward
in Triton kernels whose every output row is computed by the same instructions on the same values
whatever else shares the step. Imported only in that mode (Triton is not needed otherwise).

Why not cuBLAS and torch's reductions: a GEMM library picks its kernel, its tiles and whether to
split the reduction over K by the shape of the whole product, so one row's sum is taken in a
different order at 1, 7 or 300 rows; torch's row reductions split a long row across more threads
when there are few rows. Each is deterministic for one shape, but a token's logits then depend on
how many tokens its step holds, and greedy answers change with the company a request keeps.

Here nothing depends on the number of rows:
- `matmul`: one program per (BLOCK_M rows, BLOCK_N columns) tile, a float32 accumulator, the K
  dimension walked in increasing BLOCK_K steps, no split-K; the tile sizes and warp counts are
  constants of the dtype, never autotuned and never chosen from M. A row computes the same tile
  products whichever tile of rows it falls in (rows padded with zeros do not mix with it), and M
  is not specialised on (M == 1 is not compiled apart).
- `rms_norm`: one program per row, the whole row in one block whose size depends on the hidden
  size alone, one tree sum in float32.

The price is speed: fixed tiles leave decode steps (a few rows) with little parallelism, where
cuBLAS would split K. Hence a mode to opt into, as vLLM's batch-invariant mode and SGLang's
deterministic inference are; attention in that mode is the Triton paged kernel
(engine/attention/triton_attn.py), batch-invariant by construction.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Tile sizes: constants of the operand dtype, never of the shape (see above). Float32 operands
# multiply in full precision (no TF32), which needs half the K tile to fit shared memory.
_TILES = {torch.float32: (32, 64, 32), torch.float16: (32, 64, 64), torch.bfloat16: (32, 64, 64)}
NUM_WARPS = 4
NUM_STAGES = 2


def matmul(
    x: torch.Tensor,  # [..., K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:  # [..., N] in out_dtype (default x's)
    """x @ weight.T (+ bias), each output row independent of the others (module docstring).
    The bias is added to the float32 sum before the result is rounded to out_dtype."""
    assert weight.dim() == 2 and x.shape[-1] == weight.shape[1]
    assert x.dtype == weight.dtype and x.dtype in _TILES, (x.dtype, weight.dtype)
    if x.dim() != 2:
        out = matmul(x.reshape(-1, x.shape[-1]), weight, bias, out_dtype)
        return out.view(*x.shape[:-1], weight.shape[0])
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    (m, k), n = x.shape, weight.shape[0]
    out = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    block_m, block_n, block_k = _TILES[x.dtype]
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _matmul_kernel[grid](
        x,
        weight,
        bias if bias is not None else out,  # never read without HAS_BIAS
        out,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        IS_FP32=x.dtype == torch.float32,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )
    return out


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(
    x_ptr,  # [M, K], unit stride along K
    w_ptr,  # [N, K], unit stride along K
    bias_ptr,  # [N]
    out_ptr,  # [M, N]
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    IS_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    row_ok, col_ok = rows < M, cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for start in range(0, K, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        k_ok = ks < K
        a = tl.load(
            x_ptr + rows[:, None] * stride_xm + ks[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        b = tl.load(
            w_ptr + cols[None, :] * stride_wn + ks[:, None],
            mask=col_ok[None, :] & k_ok[:, None],
            other=0.0,
        )  # [BLOCK_K, BLOCK_N]
        if IS_FP32:
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out_offsets = rows[:, None] * stride_om + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    tl.store(out_ptr + out_offsets, acc.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / sqrt(mean(x^2) + eps)) over the last dimension, as engine.models.llama's
    RMSNorm rounds it (normalised in float32, rounded to x's dtype, then times the weight in
    x's dtype), with each row's sum one fixed tree of the row alone."""
    size = x.shape[-1]
    assert weight.shape == (size,)
    rows = x.reshape(-1, size)
    rows = rows if rows.stride(1) == 1 else rows.contiguous()
    out = torch.empty(rows.shape, dtype=torch.result_type(weight, x), device=x.device)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](
            rows,
            weight,
            out,
            size,
            rows.stride(0),
            out.stride(0),
            eps,
            BLOCK=triton.next_power_of_2(size),
            num_warps=NUM_WARPS,
        )
    return out.view(x.shape)


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [rows, size]
    w_ptr,  # [size]
    out_ptr,  # [rows, size]
    size,
    stride_x,
    stride_o,
    eps,
    BLOCK: tl.constexpr,  # size padded to a power of two
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < size
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, 0) / size + eps)
    normed = (x * inv).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    y = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a fused [..., 2 * I] projection -> [..., I], each element in float32 by
    one fixed formula (torch's CPU path picks a vectorised or a scalar exp by where an element
    falls in the tensor; here no element's value depends on the shape)."""
    size = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, 2 * size)
    rows = rows if rows.stride(1) == 1 else rows.contiguous()
    out = torch.empty(rows.shape[0], size, dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0]:
        grid = (rows.shape[0], triton.cdiv(size, _ELEMENTWISE_BLOCK))
        _silu_mul_kernel[grid](
            rows, out, size, rows.stride(0), out.stride(0), BLOCK=_ELEMENTWISE_BLOCK
        )
    return out.view(*gate_up.shape[:-1], size)


_ELEMENTWISE_BLOCK = 1024


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, size, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < size
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + size + cols, mask=ok, other=0.0).to(tl.float32)
    # Rounded where torch's F.silu(gate) * up rounds: silu to the dtype, then the product.
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (act * up).to(out_ptr.dtype.element_ty), mask=ok)
