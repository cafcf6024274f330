"""The linear layers of the Llama family: dense products through our CPU kernels where they built
(rows alike whatever the batch: engine/kernels/__init__.py), Triton's batch-invariant products on
CUDA under batch_invariant, and GGUF blocks (`QuantLinear`, `QuantEmbedding`) multiplied as they
are stored.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import cpu_kernels, quant_linear
from engine.models.gguf import QuantTensor


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


def meta_linear(in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> nn.Linear:
    """A Linear on the meta device: the loader materialises and fills every parameter."""
    return Linear(in_features, out_features, bias=bias, device="meta", dtype=dtype)
