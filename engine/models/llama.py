"""Decoder-only Llama-family transformer over a flattened ragged batch and a paged KV cache.

One implementation serves Llama (SmolLM, TinyLlama), Mistral, Qwen2/2.5 (q/k/v bias) and Qwen3
(q/k RMSNorm); `ModelConfig` carries the differences. q/k/v and gate/up projections are fused into
one matmul each (fewer, larger matmuls read the weights once). The op order follows the Hugging
Face reference so float32 greedy output matches it token for token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.base import AttentionBackend, write_kv
from engine.kernels import cpu_kernels, quant_linear
from engine.models.config import ModelConfig
from engine.models.gguf import QuantTensor


@dataclass(frozen=True)
class ForwardContext:
    """What every layer needs for one step besides its hidden states."""

    backend: AttentionBackend
    attn_metadata: Any
    kv_caches: tuple[tuple[torch.Tensor, torch.Tensor], ...]  # per layer (k_cache, v_cache)
    cos: torch.Tensor  # [num_tokens, head_dim]
    sin: torch.Tensor  # [num_tokens, head_dim]


def layer_kernels(x: torch.Tensor) -> Any | None:
    """Our CPU kernels for the parts of a layer between its linears (RMSNorm, rotary embedding,
    silu(gate) * up; engine/kernels/cpu_layer.cpp), where x is a CPU float32 or bfloat16 tensor
    and they built; None elsewhere (GPU, other dtypes), where the torch formulation below runs.
    Both round where the other does: they agree to float32 summation order."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        return None
    return cpu_kernels()


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


class RotaryEmbedding:
    """cos/sin tables for every position, computed once, theta and scaling from the checkpoint's
    config in either transformers form: 5.x's `rope_parameters`, or 4.x's `rope_scaling` with
    `rope_theta` at the top (pyproject allows both). default, linear and llama3 are computed here;
    yarn, longrope and the other types transformers' initialisers know go through them; any other
    type raises rather than falling back to unscaled frequencies (wrong output past the first
    few hundred positions: Llama 3.x's llama3 scaling)."""

    def __init__(self, hf_config: Any, head_dim: int, max_positions: int, device: torch.device):
        params = self.rope_parameters(hf_config)
        rope_type = params["rope_type"]
        theta = float(params["rope_theta"])
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float, device="cpu") / head_dim
        inv_freq = 1.0 / (theta**exponents)  # [head_dim / 2]
        scaling = 1.0
        if rope_type == "linear":
            inv_freq = inv_freq / float(params["factor"])
        elif rope_type == "llama3":
            inv_freq = self.llama3_inv_freq(inv_freq, params)
        elif rope_type == "dynamic":
            # Dynamic NTK changes theta only past the trained length; a fixed table cannot.
            trained = int(
                params.get("original_max_position_embeddings", 0)
                or getattr(hf_config, "max_position_embeddings", 0)
            )
            if max_positions > trained:
                raise ValueError(
                    f"rope type 'dynamic' rescales past {trained} positions, which specserve's "
                    f"fixed tables do not: set max_model_len <= {trained}."
                )
        elif rope_type != "default":
            inv_freq, scaling = self.transformers_inv_freq(hf_config, rope_type)
        self.inv_freq = inv_freq  # [head_dim / 2]
        # Tables are computed on the host once, then kept on the device.
        positions = torch.arange(max_positions, dtype=torch.float, device="cpu")
        freqs = positions[:, None] * inv_freq[None, :]  # [max_positions, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
        self.cos = (emb.cos() * scaling).to(device)
        self.sin = (emb.sin() * scaling).to(device)

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)

    @staticmethod
    def rope_parameters(hf_config: Any) -> dict[str, Any]:
        """The config's RoPE settings in transformers 5's form: rope_type, rope_theta and the
        scaling keys, from `rope_parameters` (5.x), else `rope_scaling` + `rope_theta` (4.x,
        whose older entries name the type `type`)."""
        given = getattr(hf_config, "rope_parameters", None)
        params = dict(given or getattr(hf_config, "rope_scaling", None) or {})
        params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", None) or 10000.0)
        return params

    @staticmethod
    def llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
        """Llama 3.1's scaling: wavelengths shorter than trained / high_freq_factor stay, longer
        than trained / low_freq_factor are divided by factor, and those between blend the two."""
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        trained = float(params["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq  # [head_dim / 2]
        smooth = (trained / wavelen - low) / (high - low)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        scaled = torch.where(wavelen > trained / low, inv_freq / factor, blended)
        return torch.where(wavelen < trained / high, inv_freq, scaled)

    @staticmethod
    def transformers_inv_freq(hf_config: Any, rope_type: str) -> tuple[torch.Tensor, float]:
        """(inv_freq, attention scaling) from the installed transformers' initialiser, which
        reads the config in its own version's form (the one AutoConfig loaded it in)."""
        import transformers
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        if rope_type not in ROPE_INIT_FUNCTIONS:
            raise ValueError(
                f"unsupported rope type {rope_type!r}: specserve computes default, linear, "
                f"llama3 and dynamic; transformers {transformers.__version__} knows "
                f"{', '.join(sorted(ROPE_INIT_FUNCTIONS))}."
            )
        try:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
        except (AttributeError, KeyError, TypeError) as e:
            raise ValueError(
                f"rope type {rope_type!r}: transformers {transformers.__version__} could not "
                f"read this config ({e!r})."
            ) from e
        return inv_freq.float(), float(scaling)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [num_tokens, heads, head_dim]; cos/sin [num_tokens, head_dim]
    kernels = layer_kernels(x)
    if kernels is not None:
        return kernels.rope(x, cos, sin)
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [num_tokens, in] -> [num_tokens, out], with the CPU kernels that stream weights fastest.

    bfloat16 and float32 weights on a CPU where our kernels built: `bf16_linear` / `f32_linear`
    (engine/kernels) at any number of rows, prefill chunks included, because each row's result
    is then the same whatever else shares the step (batch invariance: DESIGN.md), which a BLAS
    GEMM does not promise. Without them (other CPUs, SPECSERVE_CPU_KERNELS=0), torch as follows,
    fast but not batch-invariant.

    Measured here on bfloat16 weights, cycling through all 28 layers of the 1.5B model so nothing
    sits in cache: F.linear reads them at ~19-20 GB/s for 1 to 16 rows; torch.mv (one row) at
    ~26 GB/s; and weight @ x.T (the weight as the left operand) at ~25 GB/s for 2 to 16 rows and
    still ahead of F.linear up to a 256-token prefill chunk. Decode and verify steps are exactly
    these shapes, so they read the weights ~1.3x faster. float32 is left to F.linear past one
    row: there the transposed product was 2.5x slower at 2 rows (SmolLM2's shapes)."""
    if x.device.type == "cpu" and weight.dtype in (torch.bfloat16, torch.float32):
        kernels = cpu_kernels()
        if kernels is not None:
            if weight.dtype == torch.bfloat16:
                return kernels.bf16_linear(x, weight, bias)
            return kernels.f32_linear(x, weight, bias)
    if x.device.type != "cpu" or (x.dtype == torch.float32 and x.shape[0] > 1):
        return F.linear(x, weight, bias)
    if x.shape[0] == 1:
        out = torch.mv(weight, x[0])
        return (out if bias is None else out + bias).unsqueeze(0)
    # Contiguous like F.linear's output: fed the transposed layout, the CPU SDPA kernel gave
    # wrong attention in bfloat16 (a real model's answer changed), so never hand it on.
    if bias is None:
        return torch.mm(weight, x.t()).t().contiguous()
    return torch.addmm(bias.unsqueeze(1), weight, x.t()).t().contiguous()


def float32_linear(
    x: torch.Tensor, weight: torch.Tensor, batch_invariant: bool = False
) -> torch.Tensor:
    """x [num_tokens, in] @ weight.T in float32: our kernels' float32 sums as they are (any
    number of rows, on a CPU where they built; the batch-invariant GPU kernel where asked),
    elsewhere `linear`'s result converted."""
    if batch_invariant:
        return invariant_kernels().matmul(x, weight, out_dtype=torch.float32)
    if x.device.type == "cpu" and weight.dtype in (torch.bfloat16, torch.float32):
        kernels = cpu_kernels()
        if kernels is not None:
            product = kernels.bf16_linear if weight.dtype == torch.bfloat16 else kernels.f32_linear
            return product(x.float(), weight, None)
    return linear(x, weight).float()


class Linear(nn.Linear):
    """nn.Linear with the single-row GEMV fast path of `linear`, or the batch-invariant GPU
    kernel in that mode."""

    batch_invariant = False  # the GPU's batch-invariant mode (enable_batch_invariant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch_invariant:
            return invariant_kernels().matmul(x, self.weight, self.bias)
        return linear(x, self.weight, self.bias)


def invariant_kernels() -> Any:
    """engine.kernels.triton_invariant, imported on first use: only the batch-invariant mode
    needs Triton."""
    from engine.kernels import triton_invariant

    return triton_invariant


def enable_batch_invariant(model: nn.Module) -> None:
    """Switch every product, norm and SwiGLU of `model` to the batch-invariant Triton kernels
    (the GPU's `batch_invariant` mode; the CPU kernels are batch-invariant already). Everything
    else in a forward works per element (embedding, RoPE, residuals) or is the attention
    backend, which the engine's configuration has made the Triton one. A module this function
    does not know how to switch is an error, so none is left behind by a new layer."""
    for name, module in model.named_modules():
        if isinstance(module, (QuantLinear, QuantEmbedding)):
            raise ValueError(f"{name}: GGUF blocks have no batch-invariant GPU kernel.")
        if isinstance(module, nn.Linear) and not isinstance(module, Linear):
            raise ValueError(f"{name}: {type(module).__name__} has no batch-invariant route.")
        if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
            raise ValueError(f"{name}: {type(module).__name__} has no batch-invariant route.")
        if hasattr(module, "batch_invariant"):
            module.batch_invariant = True


class QuantLinear(nn.Module):
    """A linear layer whose weight is GGUF blocks (engine.models.gguf), multiplied by the CPU
    kernels in float32 without being expanded. A fused projection may mix formats (Q4_K_M files
    store some v projections in Q6_K): it keeps one block tensor per run of rows in one format.

    Built on the meta device in place of a `Linear` (only the bias, if any, is a parameter the
    loader fills); `set_weight` installs the blocks once the model is materialised."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype, device="meta")) if bias else None
        )
        self.qtypes: tuple[int, ...] = ()
        self.origins: tuple[str, ...] = ()
        self.block_names: tuple[str, ...] = ()
        # Whether the activations are quantised to int8 for the formats that allow it (the
        # engine's gguf_activations; set by the loader).
        self.int8_activations = False

    def set_weight(self, parts: list[QuantTensor]) -> None:
        """The weight's rows, in order, as runs of blocks; consecutive runs of one format merge."""
        assert sum(p.rows for p in parts) == self.out_features
        assert all(p.columns == self.in_features for p in parts)
        runs: list[QuantTensor] = []
        for part in parts:
            if runs and runs[-1].qtype == part.qtype and runs[-1].origin == part.origin:
                merged = torch.cat((runs[-1].blocks, part.blocks))
                runs[-1] = QuantTensor(merged, part.qtype, part.columns, part.origin)
            else:
                runs.append(part)
        self.block_names = tuple(f"blocks{i}" for i in range(len(runs)))
        for name, run in zip(self.block_names, runs, strict=True):
            self.register_buffer(name, run.blocks.contiguous())
        self.qtypes = tuple(run.qtype for run in runs)
        self.origins = tuple(run.origin for run in runs)

    def _blocks(self) -> list[torch.Tensor]:
        """The registered runs of blocks, in order (buffers, so they follow the module's device)."""
        return [self.get_buffer(name) for name in self.block_names]

    @property
    def parts(self) -> list[QuantTensor]:
        return [
            QuantTensor(blocks, qtype, self.in_features, origin)
            for blocks, qtype, origin in zip(self._blocks(), self.qtypes, self.origins, strict=True)
        ]

    def dequantized_weight(self) -> torch.Tensor:
        """The float32 weight [out, in] it multiplies by (the file's dequantised values)."""
        return torch.cat([part.dequantize() for part in self.parts])

    def float32_product(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T (+ bias) in float32, as the kernels compute it."""
        return quant_linear(x, self._blocks(), self.qtypes, self.bias, self.int8_activations)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.float32_product(x).to(x.dtype)

    def rows_product(self, x: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Outputs [start, end) of forward(x), multiplying by those weight rows only."""
        blocks, qtypes, first = [], [], 0
        for run, qtype in zip(self._blocks(), self.qtypes, strict=True):
            lo, hi = max(start, first), min(end, first + run.shape[0])
            if lo < hi:
                blocks.append(run[lo - first : hi - first])
                qtypes.append(qtype)
            first += run.shape[0]
        bias = None if self.bias is None else self.bias[start:end]
        return quant_linear(x, blocks, qtypes, bias, self.int8_activations).to(x.dtype)


def output_rows(layer: nn.Module, x: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """layer(x)[:, start:end] for a Linear or QuantLinear, computing only those outputs (the
    K/V part of a fused q/k/v projection, say). Each output is the same sum over the same
    weights as in layer(x)."""
    if isinstance(layer, QuantLinear):
        return layer.rows_product(x, start, end)
    assert isinstance(layer, Linear), type(layer).__name__
    weight = layer.weight[start:end]
    bias = None if layer.bias is None else layer.bias[start:end]
    if layer.batch_invariant:
        return invariant_kernels().matmul(x, weight, bias)
    return linear(x, weight, bias)


class QuantEmbedding(nn.Module):
    """An embedding table kept as GGUF blocks: a lookup dequantises just the rows it needs, and a
    tied LM head multiplies by the same blocks (`logits`)."""

    blocks: torch.Tensor  # [num_embeddings, bytes per row], a buffer set by set_weight

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.dtype = num_embeddings, embedding_dim, dtype
        self.qtype, self.origin = 0, ""
        self.int8_activations = False  # as QuantLinear's, for a tied LM head

    def set_weight(self, weight: QuantTensor) -> None:
        assert weight.rows == self.num_embeddings and weight.columns == self.embedding_dim
        self.register_buffer("blocks", weight.blocks.contiguous())
        self.qtype, self.origin = weight.qtype, weight.origin

    @property
    def quant_weight(self) -> QuantTensor:
        return QuantTensor(self.blocks, self.qtype, self.embedding_dim, self.origin)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = QuantTensor(self.blocks[input_ids], self.qtype, self.embedding_dim)
        return rows.dequantize().to(self.dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden @ table.T in float32 (a tied LM head)."""
        return quant_linear(hidden, [self.blocks], [self.qtype], int8=self.int8_activations)


def _linear(in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> nn.Linear:
    # Built on the meta device: the loader materialises and fills every parameter.
    return Linear(in_features, out_features, bias=bias, device="meta", dtype=dtype)


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
        self.qkv_proj = _linear(
            in_features or cfg.hidden_size,
            self.q_size + 2 * self.kv_size,
            cfg.attention_bias,
            dtype,
        )
        o_bias = cfg.attention_bias and cfg.architecture != "Qwen2ForCausalLM"
        self.o_proj = _linear(self.q_size, cfg.hidden_size, o_bias, dtype)
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
        q, k = _apply_rope(q, ctx.cos, ctx.sin), _apply_rope(k, ctx.cos, ctx.sin)
        k_cache, v_cache = ctx.kv_caches[self.layer_idx]
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
        self.gate_up_proj = _linear(cfg.hidden_size, 2 * cfg.intermediate_size, False, dtype)
        self.down_proj = _linear(cfg.intermediate_size, cfg.hidden_size, False, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.batch_invariant:
            return self.down_proj(invariant_kernels().silu_mul(gate_up))
        kernels = layer_kernels(gate_up)
        if kernels is not None:
            return self.down_proj(kernels.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks with residuals."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx, dtype)
        self.mlp = MLP(cfg, dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


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
            else _linear(cfg.hidden_size, cfg.vocab_size, False, dtype)
        )
        # Layers whose input an EAGLE-3 head reads (engine.models.eagle3); empty for every other
        # deployment, which then pays nothing for it.
        self.aux_layers: tuple[int, ...] = ()
        self.aux_hidden: torch.Tensor | None = None  # [num_tokens, len(aux_layers) * hidden]

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids [num_tokens] -> final hidden states [num_tokens, hidden_size]. With
        aux_layers, the residual stream entering each of them is kept in `aux_hidden`, side by
        side in aux_layers' order."""
        x = self.embed_tokens(input_ids)
        if not self.aux_layers:
            for layer in self.layers:
                x = layer(x, ctx)
            return self.norm(x)
        taps = {}
        for i, layer in enumerate(self.layers):
            if i in self.aux_layers:
                taps[i] = x
            x = layer(x, ctx)
        self.aux_hidden = torch.cat([taps[i] for i in self.aux_layers], dim=-1)
        return self.norm(x)

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
