"""GPU paged attention through flash-attn's varlen kernel with a block table.

Imported only when chosen (the registry imports this module lazily), so CPU machines never need
flash-attn. flash-attn 2 reads the paged cache directly when given `block_table`; its causal mask
is aligned to the bottom right, which is exactly "each query token sees its own context": the
semantics of the torch backend. flash-attn 2 requires the page size to be a multiple of 256.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.base import BatchLayout

PAGE_SIZE_MULTIPLE = 256


@dataclass(frozen=True)
class FlashAttentionMetadata:
    """Cumulative offsets and the padded block table for one step."""

    slot_mapping: torch.Tensor  # [num_tokens] int64
    cu_seqlens_q: torch.Tensor  # [num_reqs + 1] int32
    cu_seqlens_k: torch.Tensor  # [num_reqs + 1] int32
    max_seqlen_q: int
    max_seqlen_k: int
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32


class FlashAttentionBackend:
    """flash_attn_varlen_func over the paged cache (CUDA only)."""

    name = "flash_attn"

    def __init__(self) -> None:
        from flash_attn import flash_attn_varlen_func

        self._varlen = flash_attn_varlen_func

    def build_metadata(self, layout: BatchLayout, device: torch.device) -> FlashAttentionMetadata:
        if layout.block_size % PAGE_SIZE_MULTIPLE:
            raise ValueError(
                f"flash_attn needs block_size to be a multiple of {PAGE_SIZE_MULTIPLE}, "
                f"got {layout.block_size}."
            )
        q_lens = torch.tensor(layout.query_lens, dtype=torch.int32)
        k_lens = torch.tensor(layout.seq_lens, dtype=torch.int32)
        max_blocks = max(len(t) for t in layout.block_tables)
        table = torch.zeros(layout.num_reqs, max_blocks, dtype=torch.int32)
        for i, blocks in enumerate(layout.block_tables):
            table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        zero = torch.zeros(1, dtype=torch.int32)
        return FlashAttentionMetadata(
            slot_mapping=layout.slot_mapping.to(device),
            cu_seqlens_q=torch.cat([zero, q_lens.cumsum(0, dtype=torch.int32)]).to(device),
            cu_seqlens_k=torch.cat([zero, k_lens.cumsum(0, dtype=torch.int32)]).to(device),
            max_seqlen_q=max(layout.query_lens),
            max_seqlen_k=max(layout.seq_lens),
            block_table=table.to(device),
        )

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        metadata: FlashAttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, metadata.slot_mapping, key)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, metadata.slot_mapping, value)
        return self._varlen(
            query,
            k_cache,
            v_cache,
            cu_seqlens_q=metadata.cu_seqlens_q,
            cu_seqlens_k=metadata.cu_seqlens_k,
            max_seqlen_q=metadata.max_seqlen_q,
            max_seqlen_k=metadata.max_seqlen_k,
            softmax_scale=scale,
            causal=True,
            block_table=metadata.block_table,
        )
