"""The CUDA path's fused layer kernels: what runs between a decoder layer's linears, in Triton.

A decode step's forward on a GPU is bound by a fixed cost per kernel launch and per layer before
it is bound by bytes (the H200 run: 4.5 ms a step at batch 1 against a 0.65-ms bandwidth floor,
and only 1.8x that at 64 requests), so the layer is fused to the kernels vLLM's and SGLang's
layers launch. Per decoder layer (no q/k norm), a decode or verify step launches:

  1 residual add + RMSNorm (`add_rms_norm`; layer 0: the norm alone)
  2 q/k/v projection (one GEMM, its bias folded in)
  3 RoPE on q and k + this step's K and V into their cache slots (`rope_write_kv`)
  4 paged attention over the cache (engine/attention/triton_attn.py; a step of few tokens
    over contexts past one partition splits it in two: partials, then their merge)
  5 output projection
  6 residual add + RMSNorm
  7 gate/up projection
  8 silu(gate) * up (`silu_mul`)
  9 down projection

against 30-odd for the torch formulation (an RMSNorm alone is eight: a cast, a square, a mean, an
add, a reciprocal square root, two products and a cast back). The last layer's residual add is
fused into the final norm. `LAYER_KERNELS` states the count (one more where attention splits),
and tests/unit/test_kernel_count.py holds the CUDA path to it by counting every op and Triton
launch of a decode step.

Each kernel computes one row (a token) per program in float32 and rounds once to the tensors'
dtype, so no output depends on the other rows of the step (the batch-invariant mode may use them
as they are). Where the torch formulation rounds between ops (bfloat16 products), these differ
from it by a rounding of the last bit; in float32 they agree with it to summation order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Kernel launches of one decoder layer of a decode step on the fused path (above).
LAYER_KERNELS = 9
NUM_WARPS = 4


def add_rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    residual: torch.Tensor | None,  # [num_tokens, hidden], or None (the first layer)
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) * weight, x + residual), one launch; the sum is rounded to x's
    dtype before it is normalised (as `x + residual` in torch, then the norm). Without a
    residual: (RMSNorm(x) * weight, x)."""
    assert x.dim() == 2 and x.stride(1) == 1
    num_tokens, hidden = x.shape
    out = torch.empty_like(x)
    new_residual = torch.empty_like(x) if residual is not None else x
    if num_tokens:
        _add_rms_norm_kernel[(num_tokens,)](
            x,
            residual if residual is not None else x,
            weight,
            out,
            new_residual,
            hidden,
            x.stride(0),
            residual.stride(0) if residual is not None else 0,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=triton.next_power_of_2(hidden),
            num_warps=NUM_WARPS,
        )
    return out, new_residual


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,  # [num_tokens, hidden], contiguous
    new_residual_ptr,  # [num_tokens, hidden], contiguous (x itself without a residual)
    hidden,
    stride_x,
    stride_r,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(new_residual_ptr + row * hidden + cols, x, mask=ok)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / hidden + eps)
    # As the torch formulation: normalised in float32, rounded to the dtype, then the weight.
    normed = (xf * inv).to(x_ptr.dtype.element_ty)
    w = tl.load(weight_ptr + cols, mask=ok, other=0.0)
    y = (normed.to(tl.float32) * w.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * hidden + cols, y, mask=ok)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [num_tokens, 2 * inter] -> [.., inter]
    """silu(gate) * up for gate_up = [gate ; up], one launch, in float32 rounded once."""
    assert gate_up.dim() == 2 and gate_up.stride(1) == 1
    num_tokens, width = gate_up.shape
    inter = width // 2
    out = torch.empty(num_tokens, inter, dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens:
        block = min(1024, triton.next_power_of_2(inter))
        _silu_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
            gate_up, out, inter, gate_up.stride(0), BLOCK=block, num_warps=NUM_WARPS
        )
    return out


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, inter, stride_in, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + inter + cols, mask=ok, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * inter + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


def rope_write_kv(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotated in place
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos: torch.Tensor,  # [num_tokens, head_dim]
    sin: torch.Tensor,  # [num_tokens, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    """Rotate q in place and k into its cache slot (the rotate-half RoPE of Llama and Qwen), and
    write v beside it: one launch, one program per token. q, k and v may be views into one q/k/v
    projection (any token and head strides, unit stride along head_dim)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert q.stride(2) == k.stride(2) == v.stride(2) == 1 and head_dim % 2 == 0
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1
    if not num_tokens:
        return
    _rope_write_kv_kernel[(num_tokens,)](
        q,
        k,
        v,
        cos,
        sin,
        k_cache,
        v_cache,
        slot_mapping,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HALF=head_dim // 2,
        BLOCK_HEADS=triton.next_power_of_2(max(num_heads, num_kv_heads)),
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
        num_warps=NUM_WARPS,
    )


@triton.jit
def _rotate(x_ptr, offsets, mask, cos_lo, cos_hi, sin_lo, sin_hi, HALF: tl.constexpr):
    """The two halves of x rotated: (x1 cos - x2 sin, x2 cos + x1 sin), in float32."""
    x1 = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + offsets + HALF, mask=mask, other=0.0).to(tl.float32)
    return x1 * cos_lo - x2 * sin_lo, x2 * cos_hi + x1 * sin_hi


@triton.jit
def _rope_write_kv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    cos_ptr,
    sin_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_cs,
    stride_c_slot,
    stride_c_head,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_HEADS)[:, None]  # [BLOCK_HEADS, 1]
    dims = tl.arange(0, BLOCK_HALF)[None, :]  # [1, BLOCK_HALF]
    dim_ok = dims < HALF
    cs = tok * stride_cs + dims
    cos_lo = tl.load(cos_ptr + cs, mask=dim_ok, other=0.0).to(tl.float32)
    cos_hi = tl.load(cos_ptr + cs + HALF, mask=dim_ok, other=0.0).to(tl.float32)
    sin_lo = tl.load(sin_ptr + cs, mask=dim_ok, other=0.0).to(tl.float32)
    sin_hi = tl.load(sin_ptr + cs + HALF, mask=dim_ok, other=0.0).to(tl.float32)

    q_mask = (heads < NUM_HEADS) & dim_ok
    q_off = tok * stride_q_tok + heads * stride_q_head + dims
    q_lo, q_hi = _rotate(q_ptr, q_off, q_mask, cos_lo, cos_hi, sin_lo, sin_hi, HALF)
    tl.store(q_ptr + q_off, q_lo.to(q_ptr.dtype.element_ty), mask=q_mask)
    tl.store(q_ptr + q_off + HALF, q_hi.to(q_ptr.dtype.element_ty), mask=q_mask)

    slot = tl.load(slot_ptr + tok)
    # Slot s of the paged cache: block s // block_size, offset s % block_size, which with the
    # cache's strides is s * stride_c_slot (a block is block_size slots back to back).
    kv_mask = (heads < NUM_KV_HEADS) & dim_ok
    c_off = slot * stride_c_slot + heads * stride_c_head + dims
    k_off = tok * stride_k_tok + heads * stride_k_head + dims
    k_lo, k_hi = _rotate(k_ptr, k_off, kv_mask, cos_lo, cos_hi, sin_lo, sin_hi, HALF)
    tl.store(k_cache_ptr + c_off, k_lo.to(k_cache_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(k_cache_ptr + c_off + HALF, k_hi.to(k_cache_ptr.dtype.element_ty), mask=kv_mask)
    v_off = tok * stride_v_tok + heads * stride_v_head + dims
    v_lo = tl.load(v_ptr + v_off, mask=kv_mask, other=0.0)
    v_hi = tl.load(v_ptr + v_off + HALF, mask=kv_mask, other=0.0)
    tl.store(v_cache_ptr + c_off, v_lo.to(v_cache_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(v_cache_ptr + c_off + HALF, v_hi.to(v_cache_ptr.dtype.element_ty), mask=kv_mask)
