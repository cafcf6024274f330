"""Decoder-only Llama-family transformer over a flattened ragged batch and a paged KV cache.

One implementation serves Llama (SmolLM, TinyLlama), Mistral, Qwen2/2.5 (q/k/v bias) and Qwen3
(q/k RMSNorm); `ModelConfig` carries the differences. q/k/v and gate/up projections are fused into
one matmul each (fewer, larger matmuls read the weights once). The op order follows the Hugging
Face reference so float32 greedy output matches it token for token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.base import AttentionBackend, write_kv
from engine.kernels import cpu_kernels
from engine.models.config import ModelConfig
from engine.models.linears import (
    QuantEmbedding,
    QuantLinear,
    float32_linear,
    invariant_kernels,
    meta_linear,
    output_rows,
)


@dataclass(frozen=True)
class ForwardContext:
    """What every layer needs for one step besides its hidden states."""

    backend: AttentionBackend
    attn_metadata: Any
    kv_caches: tuple[tuple[torch.Tensor, torch.Tensor], ...]  # per layer (k_cache, v_cache)
    cos: torch.Tensor  # [num_tokens, head_dim]
    sin: torch.Tensor  # [num_tokens, head_dim]
    # The CUDA path's fused Triton layer kernels (engine/kernels/triton_layer.py), chosen once at
    # start (EngineConfig.fused_layers); False: the torch formulation, or our CPU kernels.
    fused: bool = False


def layer_kernels(x: torch.Tensor) -> Any | None:
    """Our CPU kernels for the parts of a layer between its linears (RMSNorm, rotary embedding,
    silu(gate) * up; engine/kernels/cpu_layer.cpp), where x is a CPU float32 or bfloat16 tensor
    and they built; None elsewhere (GPU, other dtypes), where the torch formulation below runs.
    Both round where the other does: they agree to float32 summation order."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        return None
    return cpu_kernels()


def fused_kernels() -> Any:
    """The fused layer kernels (imported on first use: Triton is needed only where they run)."""
    from engine.kernels import triton_layer

    return triton_layer


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [num_tokens, heads, head_dim]; cos/sin [num_tokens, head_dim]
    kernels = layer_kernels(x)
    if kernels is not None:
        return kernels.rope(x, cos, sin)
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


class RMSNorm(nn.Module):
    """Root-mean-square layer norm, computed in float32."""

    batch_invariant = False  # the GPU's batch-invariant mode (enable_batch_invariant)

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype, device="meta"))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch_invariant:
            return invariant_kernels().rms_norm(x, self.weight, self.eps)
        kernels = layer_kernels(x)
        if kernels is not None:
            return kernels.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, fused: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual stream's next value and its norm;
        without a residual, (norm(x), x). `fused`: one Triton launch for both."""
        if fused:
            return fused_kernels().add_rms_norm(x, residual, self.weight, self.eps)
        if residual is not None:
            x = x + residual
        return self(x), x


class Attention(nn.Module):
    """Self-attention with fused q/k/v projection, RoPE and a paged KV cache."""

    def __init__(
        self, cfg: ModelConfig, layer_idx: int, dtype: torch.dtype, in_features: int | None = None
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        # in_features: wider than hidden_size in an EAGLE-3 head ([embedding ; hidden]).
        self.qkv_proj = meta_linear(
            in_features or cfg.hidden_size,
            self.q_size + 2 * self.kv_size,
            cfg.attention_bias,
            dtype,
        )
        o_bias = cfg.attention_bias and cfg.architecture != "Qwen2ForCausalLM"
        self.o_proj = meta_linear(self.q_size, cfg.hidden_size, o_bias, dtype)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [num_tokens, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        k_cache, v_cache = ctx.kv_caches[self.layer_idx]
        attend = getattr(ctx.backend, "attend_written", None) if ctx.fused else None
        if attend is not None:  # RoPE and the K/V write in one launch, then attention alone
            slots = ctx.attn_metadata.slot_mapping
            fused_kernels().rope_write_kv(q, k, v, ctx.cos, ctx.sin, k_cache, v_cache, slots)
            out = attend(q, k_cache, v_cache, ctx.attn_metadata, self.scale)
        else:
            q, k = _apply_rope(q, ctx.cos, ctx.sin), _apply_rope(k, ctx.cos, ctx.sin)
            out = ctx.backend.forward(q, k, v, k_cache, v_cache, ctx.attn_metadata, self.scale)
        return self.o_proj(out.reshape(num_tokens, self.q_size))

    def write_kv(self, x: torch.Tensor, ctx: ForwardContext) -> None:
        """Only write the tokens' K/V into the cache, as forward would (no query, attention or
        output projection): for positions whose output nobody reads."""
        num_tokens = x.shape[0]
        kv = output_rows(self.qkv_proj, x, self.q_size, self.q_size + 2 * self.kv_size)
        k, v = kv.split([self.kv_size, self.kv_size], dim=-1)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k)
        k = _apply_rope(k, ctx.cos, ctx.sin)
        k_cache, v_cache = ctx.kv_caches[self.layer_idx]
        write_kv(
            k_cache,
            v_cache,
            k.to(k_cache.dtype),
            v.to(v_cache.dtype),
            ctx.attn_metadata.slot_mapping,
        )


class MLP(nn.Module):
    """SwiGLU feed-forward with fused gate/up projection."""

    batch_invariant = False  # silu(gate) * up in the GPU's batch-invariant mode

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = meta_linear(cfg.hidden_size, 2 * cfg.intermediate_size, False, dtype)
        self.down_proj = meta_linear(cfg.intermediate_size, cfg.hidden_size, False, dtype)

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if fused:  # one launch, and batch-invariant as it is (a row per program)
            return self.down_proj(fused_kernels().silu_mul(gate_up))
        if self.batch_invariant:
            return self.down_proj(invariant_kernels().silu_mul(gate_up))
        kernels = layer_kernels(gate_up)
        if kernels is not None:
            return self.down_proj(kernels.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks with residuals. The residual stream travels beside the
    layer's output (x + residual is the stream), so each residual add is done by the norm after
    it: one kernel on the fused path."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx, dtype)
        self.mlp = MLP(cfg, dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the stream before it): the stream after the layer is their
        sum. `residual` None: x is the stream itself (the first layer)."""
        h, residual = self.input_layernorm.add_forward(x, residual, ctx.fused)
        h = self.self_attn(h, ctx)
        h, residual = self.post_attention_layernorm.add_forward(h, residual, ctx.fused)
        return self.mlp(h, ctx.fused), residual


class LlamaForCausalLM(nn.Module):
    """The whole model: embeddings, decoder layers, final norm, LM head (tied or not)."""

    batch_invariant = False  # the LM head's product in the GPU's batch-invariant mode

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, device="meta", dtype=dtype
        )
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else meta_linear(cfg.hidden_size, cfg.vocab_size, False, dtype)
        )
        # Layers whose input an EAGLE-3 head reads (engine.models.eagle3.head); empty for every other
        # deployment, which then pays nothing for it.
        self.aux_layers: tuple[int, ...] = ()
        self.aux_hidden: torch.Tensor | None = None  # [num_tokens, len(aux_layers) * hidden]

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids [num_tokens] -> final hidden states [num_tokens, hidden_size]. With
        aux_layers, the residual stream entering each of them is kept in `aux_hidden`, side by
        side in aux_layers' order."""
        x = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        if not self.aux_layers:
            for layer in self.layers:
                x, residual = layer(x, residual, ctx)
            return self.norm.add_forward(x, residual, ctx.fused)[0]
        taps = {}
        for i, layer in enumerate(self.layers):
            if i in self.aux_layers:
                taps[i] = x if residual is None else x + residual
            x, residual = layer(x, residual, ctx)
        self.aux_hidden = torch.cat([taps[i] for i in self.aux_layers], dim=-1)
        return self.norm.add_forward(x, residual, ctx.fused)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [num_rows, hidden_size] -> logits [num_rows, vocab_size] in float32. Where the
        product is computed in float32 (the CPU kernels) it is kept unrounded: rounded to
        bfloat16, a 150k vocabulary's two best logits tie often enough to decide greedy output."""
        if isinstance(self.lm_head, QuantLinear):
            return self.lm_head.float32_product(hidden)
        if self.lm_head is None and isinstance(self.embed_tokens, QuantEmbedding):
            return self.embed_tokens.logits(hidden)
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return float32_linear(hidden, head.weight, self.batch_invariant)
