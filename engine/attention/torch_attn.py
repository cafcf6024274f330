"""Reference paged attention in plain torch: gather K/V through the block tables, masked SDPA.

Two paths share one contract. When every request has the same number of query tokens (all decode,
or all verifying the same number of drafts) the batch is padded to the longest context and run as
one SDPA call. Otherwise (prefill chunks mixed with decodes) each request runs its own SDPA call
over its own context. Both gather K/V with one index per layer from slot indices built once per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.base import BatchLayout
from engine.device import to_device


@dataclass(frozen=True)
class TorchAttentionMetadata:
    """Index tensors for one step, built once and reused by every layer."""

    slot_mapping: torch.Tensor  # [num_tokens] int64
    # Uniform path: every request has query_len tokens.
    ctx_slots: torch.Tensor | None  # [num_reqs, max_seq_len] int64 (padded with slot 0)
    mask: torch.Tensor | None  # [num_reqs, 1, query_len, max_seq_len] bool, None = attend to all
    # Ragged path: per request (query start, query end, context slots, causal mask or None).
    ragged: tuple[tuple[int, int, torch.Tensor, torch.Tensor | None], ...]


def _causal_mask(query_len: int, seq_len: int, device: torch.device) -> torch.Tensor | None:
    """[query_len, seq_len] bool: query i sits at position seq_len - query_len + i."""
    if query_len == 1:
        return None
    rows = torch.arange(query_len, device=device)[:, None] + (seq_len - query_len)
    return torch.arange(seq_len, device=device)[None, :] <= rows


class TorchAttentionBackend:
    """Paged attention with torch ops; the reference every other backend is held against."""

    name = "torch"

    def build_metadata(self, layout: BatchLayout, device: torch.device) -> TorchAttentionMetadata:
        bs = layout.block_size
        per_req_slots = []
        for table, seq_len in zip(layout.block_tables, layout.seq_lens, strict=True):
            blocks = torch.tensor(
                table[: (seq_len + bs - 1) // bs], dtype=torch.int64, device="cpu"
            )
            offsets = torch.arange(bs, device="cpu")
            slots = (blocks[:, None] * bs + offsets[None, :]).flatten()[:seq_len]
            per_req_slots.append(to_device(slots, device))

        if len(set(layout.query_lens)) == 1:
            return self._uniform(layout, per_req_slots, device)
        ragged = []
        start = 0
        for query_len, seq_len, slots in zip(
            layout.query_lens, layout.seq_lens, per_req_slots, strict=True
        ):
            ragged.append(
                (start, start + query_len, slots, _causal_mask(query_len, seq_len, device))
            )
            start += query_len
        slot_mapping = to_device(layout.slot_mapping, device)
        return TorchAttentionMetadata(slot_mapping, None, None, tuple(ragged))

    def _uniform(
        self, layout: BatchLayout, per_req_slots: list[torch.Tensor], device: torch.device
    ) -> TorchAttentionMetadata:
        query_len = layout.query_lens[0]
        max_len = max(layout.seq_lens)
        ctx_slots = torch.zeros(layout.num_reqs, max_len, dtype=torch.int64, device=device)
        for i, slots in enumerate(per_req_slots):
            ctx_slots[i, : slots.numel()] = slots
        mask = None
        if len(set(layout.seq_lens)) > 1 or query_len > 1:
            seq_lens = to_device(torch.tensor(layout.seq_lens, device="cpu"), device)
            # Position of each query row, then "key position <= query position" (which also masks
            # the padding past each request's own context).
            q_pos = seq_lens[:, None] - query_len + torch.arange(query_len, device=device)[None, :]
            k_pos = torch.arange(max_len, device=device)
            mask = (k_pos[None, None, :] <= q_pos[:, :, None])[:, None]
        return TorchAttentionMetadata(to_device(layout.slot_mapping, device), ctx_slots, mask, ())

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        metadata: TorchAttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        k_flat = k_cache.view(-1, num_kv_heads, head_dim)  # [num_slots, num_kv_heads, head_dim]
        v_flat = v_cache.view(-1, num_kv_heads, head_dim)
        k_flat.index_copy_(0, metadata.slot_mapping, key)
        v_flat.index_copy_(0, metadata.slot_mapping, value)

        if metadata.ctx_slots is not None:
            num_reqs = metadata.ctx_slots.shape[0]
            q = query.view(num_reqs, -1, *query.shape[1:]).transpose(1, 2)  # [B, H, q_len, D]
            k = k_flat[metadata.ctx_slots].transpose(1, 2)  # [B, KVH, max_seq_len, D]
            v = v_flat[metadata.ctx_slots].transpose(1, 2)
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=metadata.mask, scale=scale, enable_gqa=True
            )
            return out.transpose(1, 2).reshape(query.shape)

        out = torch.empty_like(query)
        for start, end, slots, mask in metadata.ragged:
            q = query[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
            k = k_flat[slots].transpose(0, 1).unsqueeze(0)  # [1, KVH, seq_len, D]
            v = v_flat[slots].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=scale, enable_gqa=True
            )
            out[start:end] = o[0].transpose(0, 1)
        return out
