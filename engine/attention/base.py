"""The attention backend interface and the batch layout every backend builds from.

A step is one flattened, ragged batch: the query tokens of all scheduled requests back to back
(prefill chunks, decode tokens and draft tokens to verify alike). Each request's query tokens attend
causally to its cached context and to each other. KV lives in paged blocks: one pair of tensors per
layer shaped [num_blocks, block_size, num_kv_heads, head_dim].
"""

from __future__ import annotations

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
