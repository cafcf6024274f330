"""Paged attention on the CPU: every step by our kernel, prompt chunks included.

The torch backend gathers each request's whole context into dense K/V tensors every layer and
hands them to SDPA, whose set-up per call outweighs a decode row's arithmetic and whose blocked
arithmetic depends on the number of queries. `paged_attention` (engine/kernels/cpu_layer.cpp)
instead reads each K/V row where it lies in its block, writes the step's new K/V itself, and
computes each query token by the same operations in the same order whatever else is in the step:
a request's attention output is the same in a decode step, a verify step, a prompt chunk of any
length, alone or beside other requests (batch invariance: DESIGN.md). So it takes every step;
a step mixing prompt chunks with decode rows no longer sends the decode rows down another path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.base import BatchLayout
from engine.attention.torch_attn import TorchAttentionBackend
from engine.kernels import cpu_kernels


@dataclass(frozen=True)
class CpuPagedMetadata:
    """Index tensors of a step, built once and read by every layer."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: where each new token's K/V goes
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int32, padded with block 0
    seq_lens: torch.Tensor  # [num_reqs] int32: context after this step
    query_start: torch.Tensor  # [num_reqs + 1] int32: first query token of each request


class CpuAttentionBackend(TorchAttentionBackend):
    """Paged attention by the CPU kernel for every step (the torch backend's methods remain for
    metadata built by it, e.g. in tests)."""

    name = "cpu"

    def build_metadata(self, layout: BatchLayout, device: torch.device):
        bs = layout.block_size
        used = [-(-seq_len // bs) for seq_len in layout.seq_lens]
        width = max(used)
        tables = [
            list(table[:n]) + [0] * (width - n)
            for table, n in zip(layout.block_tables, used, strict=True)
        ]
        starts = [0]
        for query_len in layout.query_lens:
            starts.append(starts[-1] + query_len)
        return CpuPagedMetadata(
            slot_mapping=layout.slot_mapping,
            block_tables=torch.tensor(tables, dtype=torch.int32, device="cpu"),
            seq_lens=torch.tensor(layout.seq_lens, dtype=torch.int32, device="cpu"),
            query_start=torch.tensor(starts, dtype=torch.int32, device="cpu"),
        )

    def forward(self, query, key, value, k_cache, v_cache, metadata, scale: float) -> torch.Tensor:
        if not isinstance(metadata, CpuPagedMetadata):
            return super().forward(query, key, value, k_cache, v_cache, metadata, scale)
        kernels = cpu_kernels()
        assert kernels is not None, "the cpu backend is chosen only where the kernels built"
        return kernels.paged_attention(
            query,
            key,
            value,
            k_cache,
            v_cache,
            metadata.slot_mapping,
            metadata.block_tables,
            metadata.seq_lens,
            metadata.query_start,
            scale,
        )
