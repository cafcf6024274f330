"""Paged attention on the CPU: decode and verify steps by our kernel, prefill by the torch path.

A decode or verify step has a few query tokens per request. The torch backend gathers each
request's whole context into dense K/V tensors every layer and hands them to SDPA, whose set-up
per call outweighs one query row's arithmetic; `paged_attention` (engine/kernels/cpu_layer.cpp)
instead reads each K/V row where it lies in its block and writes the step's new K/V itself. A step
with a longer query (a prefill chunk) is the torch backend's: there SDPA's blocked arithmetic wins.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.base import BatchLayout
from engine.attention.torch_attn import TorchAttentionBackend
from engine.kernels import ALWAYS_ROWS, cpu_kernels

# Longest query (tokens per request) a step may have for the kernel to take it: decode steps and
# verify steps of up to this many drafts + 1, the shapes the linears' own kernel takes too.
MAX_KERNEL_QUERY = ALWAYS_ROWS


@dataclass(frozen=True)
class CpuPagedMetadata:
    """Index tensors of a decode or verify step, built once and read by every layer."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: where each new token's K/V goes
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int32, padded with block 0
    seq_lens: torch.Tensor  # [num_reqs] int32: context after this step
    query_start: torch.Tensor  # [num_reqs + 1] int32: first query token of each request


class CpuAttentionBackend(TorchAttentionBackend):
    """The torch backend, with steps of short queries run by the CPU paged-attention kernel."""

    name = "cpu"

    def build_metadata(self, layout: BatchLayout, device: torch.device):
        if max(layout.query_lens) > MAX_KERNEL_QUERY:
            return super().build_metadata(layout, device)
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
        return cpu_kernels().paged_attention(
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
