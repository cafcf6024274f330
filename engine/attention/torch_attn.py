"""Reference paged attention in plain torch: gather K/V through the block tables, masked SDPA.

The requests of a step are attended in groups, one SDPA call per group over K/V gathered for that
group alone:
- when every request has the same number of query tokens (all decode, or all verifying the same
  number of drafts), consecutive requests share a group, padded to the group's longest context;
- otherwise (prompt chunks mixed with decodes) each request is a group of its own.
The gathered K/V are the one cost here that grows with the batch's contexts, so they are bounded:
a group's padded length times its requests stays within the backend's `workspace_tokens`, unless
a single request's context is longer, which is then gathered alone. So a layer never holds more
than `max_gathered_tokens(longest context)` tokens of gathered K (and as many of V), whatever the
batch: the workspace engine/execution/kv_plan.py reserves for this backend. Index tensors are built once per
step and reused by every layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.base import BatchLayout, write_kv
from engine.runtime.device import to_device

# Context tokens one layer's gather may hold for a group of requests (of K; as many of V). 128 MiB
# of K and V together for Llama-3.1-8B in bf16 (8 KV heads of 128): a decode batch of 64 requests
# of 512 tokens or 8 of 4k is still one SDPA call.
GATHER_WORKSPACE_TOKENS = 32768


@dataclass(frozen=True)
class AttentionGroup:
    """Requests attended by one SDPA call: their query rows in the step and their contexts."""

    start: int  # first query row of the group in the step
    end: int  # one past its last query row
    ctx_slots: torch.Tensor  # [num_group_reqs, max_seq_len] int64 (padded with slot 0)
    mask: torch.Tensor | None  # [num_group_reqs, 1, query_len, max_seq_len] bool; None: see all


@dataclass(frozen=True)
class TorchAttentionMetadata:
    """Index tensors for one step, built once and reused by every layer."""

    slot_mapping: torch.Tensor  # [num_tokens] int64
    groups: tuple[AttentionGroup, ...]


def group_requests(
    query_lens: Sequence[int], seq_lens: Sequence[int], workspace_tokens: int
) -> list[tuple[int, int]]:
    """Consecutive request ranges [first, last) attended together: all requests one query length
    and every group's (longest context x requests) within workspace_tokens, a request longer than
    that alone; requests of different query lengths one by one."""
    if len(set(query_lens)) > 1:
        return [(i, i + 1) for i in range(len(query_lens))]
    groups, first, longest = [], 0, 0
    for i, seq_len in enumerate(seq_lens):
        if i > first and max(longest, seq_len) * (i + 1 - first) > workspace_tokens:
            groups.append((first, i))
            first, longest = i, 0
        longest = max(longest, seq_len)
    groups.append((first, len(seq_lens)))
    return groups


def _context_slots(layout: BatchLayout, first: int, last: int) -> torch.Tensor:
    """[last - first, longest context] int64 on the host: the cache slot of every context
    position of requests first .. last - 1, padded with slot 0 (masked, or past the context)."""
    bs = layout.block_size
    seq_lens = layout.seq_lens[first:last]
    offsets = torch.arange(bs, dtype=torch.int64, device="cpu")  # [block_size]
    slots = torch.zeros(len(seq_lens), max(seq_lens), dtype=torch.int64, device="cpu")
    for row, (table, seq_len) in enumerate(
        zip(layout.block_tables[first:last], seq_lens, strict=True)
    ):
        blocks = torch.tensor(table[: -(-seq_len // bs)], dtype=torch.int64, device="cpu")
        slots[row, :seq_len] = (blocks[:, None] * bs + offsets[None, :]).flatten()[:seq_len]
    return slots


def _causal_mask(
    query_len: int, seq_lens: Sequence[int], device: torch.device
) -> torch.Tensor | None:
    """[len(seq_lens), 1, query_len, max(seq_lens)] bool: "key position <= query position", which
    also masks the padding past each request's own context; None when nothing needs masking
    (one query per request, every context the padded length)."""
    if query_len == 1 and len(set(seq_lens)) == 1:
        return None
    lens = to_device(torch.tensor(seq_lens, dtype=torch.int64, device="cpu"), device)  # [g]
    q_pos = lens[:, None] - query_len + torch.arange(query_len, device=device)[None, :]
    k_pos = torch.arange(max(seq_lens), device=device)  # [max_seq_len]
    return (k_pos[None, None, :] <= q_pos[:, :, None])[:, None]


class TorchAttentionBackend:
    """Paged attention with torch ops; the reference every other backend is held against."""

    name = "torch"

    def __init__(self, workspace_tokens: int = GATHER_WORKSPACE_TOKENS) -> None:
        self.workspace_tokens = workspace_tokens

    def max_gathered_tokens(self, max_seq_len: int) -> int:
        """The most context tokens of K (and as many of V) one layer gathers at once in a step
        whose longest context is max_seq_len."""
        return max(self.workspace_tokens, max_seq_len)

    def build_metadata(self, layout: BatchLayout, device: torch.device) -> TorchAttentionMetadata:
        groups = []
        start = 0
        for first, last in group_requests(
            layout.query_lens, layout.seq_lens, self.workspace_tokens
        ):
            query_len = layout.query_lens[first]
            end = start + query_len * (last - first)
            ctx_slots = to_device(_context_slots(layout, first, last), device)
            mask = _causal_mask(query_len, layout.seq_lens[first:last], device)
            groups.append(AttentionGroup(start, end, ctx_slots, mask))
            start = end
        return TorchAttentionMetadata(to_device(layout.slot_mapping, device), tuple(groups))

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
        # [num_slots, num_kv_heads, head_dim] each
        k_flat, v_flat = write_kv(k_cache, v_cache, key, value, metadata.slot_mapping)
        out = torch.empty_like(query)
        for group in metadata.groups:
            rows = slice(group.start, group.end)
            out[rows] = _attend(query[rows], k_flat, v_flat, group, scale)
        return out


def _attend(
    query: torch.Tensor,  # [num_group_tokens, num_heads, head_dim]
    k_flat: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    v_flat: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    group: AttentionGroup,
    scale: float,
) -> torch.Tensor:  # [num_group_tokens, num_heads, head_dim]
    """One group's SDPA. Its gathered K/V are locals, freed on return: only one group's gather
    is alive at a time."""
    num_reqs = group.ctx_slots.shape[0]
    q = query.view(num_reqs, -1, *query.shape[1:]).transpose(1, 2)  # [g, H, q_len, D]
    k = k_flat[group.ctx_slots].transpose(1, 2)  # [g, KVH, max_seq_len, D]
    v = v_flat[group.ctx_slots].transpose(1, 2)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=group.mask, scale=scale, enable_gqa=True
    )  # [g, H, q_len, D]
    return out.transpose(1, 2).reshape(query.shape)
