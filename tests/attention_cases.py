"""Random paged-attention problems and a dense reference, shared by the CPU and GPU tests."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from engine.attention import BatchLayout


@dataclass
class PagedCase:
    """Requests with cached context and new query tokens, laid out in a shuffled block pool."""

    layout: BatchLayout
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    full_k: list[torch.Tensor]  # per request [seq_len, num_kv_heads, head_dim]
    full_v: list[torch.Tensor]


def make_case(
    query_lens: list[int],
    context_lens: list[int],
    block_size: int,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    seed: int = 0,
) -> PagedCase:
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    seq_lens = [q + c for q, c in zip(query_lens, context_lens, strict=True)]
    blocks_needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_needed) + 3
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.zeros(shape, dtype=dtype)
    v_cache = torch.zeros(shape, dtype=dtype)
    tables, slots, queries, keys, values, full_k, full_v = [], [], [], [], [], [], []
    for q_len, ctx_len, seq_len, n_blocks in zip(
        query_lens, context_lens, seq_lens, blocks_needed, strict=True
    ):
        table = [pool.pop() for _ in range(n_blocks)]
        tables.append(tuple(table))
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        full_k.append(k)
        full_v.append(v)
        for pos in range(seq_len):
            block, offset = table[pos // block_size], pos % block_size
            if pos < ctx_len:  # already cached
                k_cache[block, offset] = k[pos]
                v_cache[block, offset] = v[pos]
            else:
                slots.append(block * block_size + offset)
        keys.append(k[ctx_len:])
        values.append(v[ctx_len:])
        queries.append(torch.randn(q_len, num_heads, head_dim, generator=gen).to(dtype))
    layout = BatchLayout(
        query_lens=tuple(query_lens),
        seq_lens=tuple(seq_lens),
        block_tables=tuple(tables),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_size=block_size,
    )
    to = dict(device=device)
    return PagedCase(
        layout,
        torch.cat(queries).to(**to),
        torch.cat(keys).to(**to),
        torch.cat(values).to(**to),
        k_cache.to(**to),
        v_cache.to(**to),
        full_k,
        full_v,
    )


def dense_reference(case: PagedCase, scale: float, window: int | None = None) -> torch.Tensor:
    """Causal attention of each request's queries over its whole sequence, in float32; with a
    `window`, a query at position p over keys p - window + 1 .. p only."""
    outs = []
    start = 0
    for q_len, k, v in zip(case.layout.query_lens, case.full_k, case.full_v, strict=True):
        q = case.query[start : start + q_len].float().cpu()  # [q_len, H, D]
        start += q_len
        seq_len = k.shape[0]
        groups = q.shape[1] // k.shape[1]
        kk = k.float().repeat_interleave(groups, dim=1)  # [seq, H, D]
        vv = v.float().repeat_interleave(groups, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, kk) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        mask = torch.arange(seq_len)[None, :] <= q_pos  # [q_len, seq]
        if window is not None:
            mask &= torch.arange(seq_len)[None, :] > q_pos - window
        scores = scores.masked_fill(~mask, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv))
    return torch.cat(outs)


# Steps of every shape a paged backend meets: (query_lens, context_lens). Contexts cross 64-key
# tiles (the Triton kernel's) and 16-token pages; a mixed step holds a prompt chunk, decodes and
# verify chunks together.
PAGED_STEPS = {
    "decode_ragged": ([1, 1, 1, 1], [0, 5, 70, 16]),
    "prefill": ([21], [0]),
    "prefill_chunk_after_context": ([8], [67]),
    "verify": ([4, 4], [9, 61]),
    "mixed": ([13, 1, 5, 1, 3], [0, 12, 64, 40, 30]),
}


def request_alone(case: PagedCase, index: int, query_len: int) -> tuple[BatchLayout, slice]:
    """Request `index` of `case` as a step of its own whose chunk is its last `query_len` query
    tokens (its earlier ones taken as cached): the layout, and the rows of `case.query` (and of
    the step's output) those tokens are. Run after `case`'s step has written its K/V."""
    layout = case.layout
    first = sum(layout.query_lens[:index])
    rows = slice(first + layout.query_lens[index] - query_len, first + layout.query_lens[index])
    alone = BatchLayout(
        query_lens=(query_len,),
        seq_lens=(layout.seq_lens[index],),
        block_tables=(layout.block_tables[index],),
        slot_mapping=layout.slot_mapping[rows],
        block_size=layout.block_size,
    )
    return alone, rows
