"""The attention backend interface and the batch layout every backend builds from.

A step is one flattened, ragged batch: the query tokens of all scheduled requests back to back
(prefill chunks, decode tokens and draft tokens to verify alike). Each request's query tokens attend
causally to its cached context and to each other. KV lives in paged blocks: one pair of tensors per
layer shaped [num_blocks, block_size, num_kv_heads, head_dim].
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass(frozen=True)
class BatchLayout:
    """Where each request's tokens sit in the flattened batch and in the paged cache."""

    query_lens: tuple[int, ...]  # tokens computed this step, per request
    seq_lens: tuple[int, ...]  # context after this step (cached + new), per request
    block_tables: tuple[tuple[int, ...], ...]  # KV block ids, per request
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot each new token's K/V goes to
    block_size: int

    def __post_init__(self) -> None:
        assert len(self.query_lens) == len(self.seq_lens) == len(self.block_tables)
        assert all(0 < q <= s for q, s in zip(self.query_lens, self.seq_lens, strict=True))
        assert self.slot_mapping.numel() == sum(self.query_lens)

    @property
    def num_reqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.numel())


@dataclass(frozen=True)
class FlatStep:
    """A step's chunks flattened back to back: what a forward feeds the model."""

    layout: BatchLayout
    token_ids: list[int]  # [num_tokens]
    positions: list[int]  # [num_tokens]
    logit_rows: list[int]  # rows whose logits are asked for, in chunk order


def flatten_step(chunks: Sequence[Any], block_size: int) -> FlatStep:
    """Flatten a step's chunks (engine.execution.runner.SeqChunk: token_ids, start, block_table,
    num_logits) into token ids, positions, cache slots and the rows that need logits."""
    token_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    logit_rows: list[int] = []
    for c in chunks:
        span = range(c.start, c.start + len(c.token_ids))
        token_ids += c.token_ids
        positions += span
        table = c.block_table
        slots += [table[p // block_size] * block_size + p % block_size for p in span]
        logit_rows += range(len(token_ids) - c.num_logits, len(token_ids))
    layout = BatchLayout(
        query_lens=tuple(len(c.token_ids) for c in chunks),
        seq_lens=tuple(c.start + len(c.token_ids) for c in chunks),
        block_tables=tuple(tuple(c.block_table) for c in chunks),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device="cpu"),
        block_size=block_size,
    )
    return FlatStep(layout, token_ids, positions, logit_rows)


def write_kv(
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64: slot = block * block_size + offset
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write a step's new K/V into their cache slots (no host sync: capturable in a CUDA
    graph) -> the caches viewed as [num_slots, num_kv_heads, head_dim]."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    k_flat.index_copy_(0, slot_mapping, key)
    v_flat.index_copy_(0, slot_mapping, value)
    return k_flat, v_flat


class AttentionBackend(Protocol):
    """Paged attention over a flattened batch. Implementations are registered by name."""

    name: str

    def build_metadata(self, layout: BatchLayout, device: torch.device) -> Any:
        """Precompute per-step index tensors once; every layer reuses them."""
        ...

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        metadata: Any,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Write this step's K/V into the cache, then attend."""
        ...
