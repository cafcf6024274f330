"""GPU paged attention in Triton: what a CUDA node serves with when flash-attn is not installed.

Imported only when chosen (the registry imports this module lazily), so machines without Triton
never need it. One kernel launch per layer runs the whole step: prompt chunks, verify chunks and
decode tokens alike. Each query token attends causally to its request's cached context and to the
tokens before it in its own chunk (key positions 0 .. its own position, as the torch reference),
optionally only to the last `sliding_window` of them. K/V are read in place through the block
table, so nothing is gathered per layer; this step's new K/V are written into their slots with
`write_kv` first.

The grid is (query token, KV head). A program takes the GQA group of query heads that share one
KV head, [BLOCK_H, head_dim] (the group padded to 16 rows for `tl.dot`), and walks its request's
keys in tiles of BLOCK_N positions, an online softmax in float32 (exp2, the scale folded into
log2(e)). Each key position is mapped to its cache slot (block_table[pos // block_size] *
block_size + pos % block_size), so any page size works and a tile may span several pages.

Batch invariance (a query row's output bits do not depend on the other requests of the step nor
on its chunk's length): everything a program reads is its own token's query heads, its own
position and its own request's block table, and it reduces over tiles starting at position 0
(or at the window's first tile, a function of the position alone) in increasing order, each tile
the same BLOCK_N positions. BLOCK_H, BLOCK_D, BLOCK_N and num_warps depend only on the model
(head_dim, the GQA group size), never on the batch, and are never autotuned. So the same token at
the same position over the same cache runs the same instructions on the same values, whether it
is decoded alone or sits in a 2k-token prompt chunk beside 60 decodes.

Split contexts (flash-decoding). One program per (token, KV head) leaves a card idle when a step
has few tokens: 2 programs for a 2-KV-head model at batch 1, on 132 SMs. Keys are therefore
taken in fixed partitions of PARTITION positions (position-aligned: partition j holds keys
j * PARTITION .. (j + 1) * PARTITION - 1), each reduced by its own online softmax from a fresh
state into a partial (max, sum, weighted V), and the partials merged in increasing partition
order by `_merge`. A step runs this one of two ways, by the same arithmetic:
- in one launch (`paged_attention_kernel`): a program walks its token's partitions in order,
  merging each partial into its running one as it finishes it;
- split (`partial_attention_kernel`, then `merge_partials_kernel`): one program per (token,
  KV head, partition) writes its partial in float32 to a scratch tensor, and one program per
  (token, KV head) merges them in the same order by the same `_merge`.
The partials and the merges are the same float32 operations on the same values either way, so a
token's output bits do not depend on the path, and the path may follow the step: split while
the step's programs are too few to fill a card (`split_tokens`), in one launch otherwise. A
context within one partition has one partial, merged exactly (x * 1 + 0 * 0), so it gets the
bits of a plain online softmax over its tiles. The scratch is bounded (SPLIT_SCRATCH_BYTES: a
step splits at most as many tokens as it holds) and counted in the memory plan
(`TritonAttentionBackend.workspace_bytes`, engine/execution/kv_plan.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from engine.attention.base import BatchLayout, write_kv
from engine.attention.triton_kernels import (
    merge_partials_kernel,
    paged_attention_kernel,
    partial_attention_kernel,
)
from engine.models.config import ModelConfig
from engine.runtime.device import to_device

# Key positions per tile. Fixed (see "Batch invariance" above): 64 keys x head_dim 128 of K and
# of V in bf16 is 32 KiB per tile, comfortably in registers and shared memory at 4 warps.
BLOCK_N = 64
NUM_WARPS = 4
# tl.dot needs at least 16 rows and 16 columns per operand on NVIDIA GPUs.
MIN_DOT_DIM = 16
# The window of a backend without one: longer than any context, so every tile starts at 0.
NO_WINDOW = 1 << 30
# Key positions per partition (a multiple of BLOCK_N). Fixed, as BLOCK_N: it sets the order of
# the reduction. 4 tiles: a 4k context is 16 partitions, 32 programs per token for 2 KV heads.
PARTITION = 256
# A step splits while it has fewer programs than this (about two per SM on an H100/H200): past
# it the programs fill the card and the partials' round trip through memory would only cost.
SPLIT_BELOW_PROGRAMS = 256
# The most bytes of partials one split launch writes (one layer's: layers run in turn).
SPLIT_SCRATCH_BYTES = 64 * 2**20


@dataclass(frozen=True)
class TritonAttentionMetadata:
    """Where each query token sits: its request and its position; built once per step."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token's K/V
    token_seq: torch.Tensor  # [num_tokens] int32: the request (block-table row) of each token
    token_pos: torch.Tensor  # [num_tokens] int32: each token's position; it sees keys 0 .. pos
    block_table: torch.Tensor  # [num_seqs, max_blocks] int32, padded with block 0
    max_seq_len: int  # the longest context a token sees (a graph's: the model's maximum)


def token_positions(layout: BatchLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """([num_tokens] request index, [num_tokens] position) of every query token, on the host:
    request i's query tokens are the last query_lens[i] positions of its seq_lens[i]."""
    q_lens = torch.tensor(layout.query_lens, dtype=torch.int64, device="cpu")  # [num_seqs]
    seq_lens = torch.tensor(layout.seq_lens, dtype=torch.int64, device="cpu")  # [num_seqs]
    requests = torch.arange(layout.num_reqs, device="cpu")  # [num_seqs]
    token_seq = torch.repeat_interleave(requests, q_lens)  # [num_tokens]
    first_row = torch.cumsum(q_lens, 0) - q_lens  # [num_seqs]: first query row of each request
    rows = torch.arange(layout.num_tokens, device="cpu")  # [num_tokens]
    row_in_chunk = rows - first_row[token_seq]  # [num_tokens]
    token_pos = (seq_lens - q_lens)[token_seq] + row_in_chunk  # [num_tokens]
    return token_seq.to(torch.int32), token_pos.to(torch.int32)


def padded_block_table(layout: BatchLayout) -> torch.Tensor:
    """[num_seqs, max_blocks] int32 on the host; rows shorter than the longest padded with 0
    (never read: the kernel reads only the blocks of positions up to the token's own)."""
    max_blocks = max(len(t) for t in layout.block_tables)
    table = torch.zeros(layout.num_reqs, max_blocks, dtype=torch.int32, device="cpu")
    for i, blocks in enumerate(layout.block_tables):
        table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32, device="cpu")
    return table


class StaticTritonMetadata:
    """The kernel's metadata at fixed addresses, for steps padded to a captured token count
    (engine.execution.cuda_graphs). A graph captured for T tokens launches T x num_kv_heads programs; a
    step of n <= T real tokens in r sequences is laid out as:
    - tokens 0 .. n-1: the real ones (their request's row of the block table, their position,
      their cache slot);
    - padded token j (n + j): request row r, whose blocks are all `pad_block` (a block no request
      owns), position 0; it writes its K/V to slot j mod block_size of the pad block, so padding
      never touches a real request's cache, and attends to that block alone.
    Every output row is computed (padded rows are dropped by the caller). Host copies go through
    pinned mirrors and do not block: the caller must not refill before the previous refill's
    copies have run (CudaGraphs fences them)."""

    def __init__(
        self, max_tokens: int, max_blocks_per_seq: int, block_size: int, device: torch.device
    ) -> None:
        self.max_tokens, self.max_blocks_per_seq, self.block_size = (
            max_tokens,
            max_blocks_per_seq,
            block_size,
        )
        pin = device.type == "cuda"

        def tensors(on: torch.device, pinned: bool) -> TritonAttentionMetadata:
            def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
                return torch.zeros(shape, dtype=dtype, device=on, pin_memory=pinned)

            return TritonAttentionMetadata(
                slot_mapping=zeros(max_tokens, dtype=torch.int64),
                token_seq=zeros(max_tokens, dtype=torch.int32),
                token_pos=zeros(max_tokens, dtype=torch.int32),
                # One row per request, and the pad row: at most max_tokens rows in all.
                block_table=zeros(max_tokens, max_blocks_per_seq, dtype=torch.int32),
                max_seq_len=max_blocks_per_seq * block_size,
            )

        self._host = tensors(torch.device("cpu"), pin)
        self._device = tensors(device, False)

    def view(
        self, num_tokens: int, max_seqlen_q: int, max_seqlen_k: int
    ) -> TritonAttentionMetadata:
        """The metadata a graph of `num_tokens` tokens captures: prefixes of the fixed tensors
        and the longest context a replay may bring (which sizes the split path's grid; each
        program reads its own token's length)."""
        assert 1 <= num_tokens <= self.max_tokens
        d = self._device
        return TritonAttentionMetadata(
            slot_mapping=d.slot_mapping[:num_tokens],
            token_seq=d.token_seq[:num_tokens],
            token_pos=d.token_pos[:num_tokens],
            block_table=d.block_table,
            max_seq_len=max_seqlen_k,
        )

    def fill(self, layout: BatchLayout, num_tokens: int, pad_block: int) -> None:
        """Lay out `layout` (the real step) padded to `num_tokens` tokens, as the class says,
        and copy it into the device tensors (non-blocking from pinned memory on CUDA)."""
        bs, n, r, t = self.block_size, layout.num_tokens, layout.num_reqs, num_tokens
        # r <= n: a step that fills its graph (n == t) needs r rows, a padded one r + 1 <= t.
        assert layout.block_size == bs and r <= n <= t <= self.max_tokens
        h = self._host
        token_seq, token_pos = token_positions(layout)
        h.slot_mapping[:n].copy_(layout.slot_mapping)
        h.token_seq[:n].copy_(token_seq)
        h.token_pos[:n].copy_(token_pos)
        pads = torch.arange(t - n, dtype=torch.int64, device="cpu")
        h.slot_mapping[n:t].copy_(pads % bs + pad_block * bs)
        h.token_seq[n:t].fill_(r)
        h.token_pos[n:t].zero_()
        rows = r + 1 if t > n else r
        h.block_table[:rows].fill_(pad_block)
        for i, (blocks, seq_len) in enumerate(
            zip(layout.block_tables, layout.seq_lens, strict=True)
        ):
            used = -(-seq_len // bs)
            assert used <= self.max_blocks_per_seq and used <= len(blocks)
            h.block_table[i, :used] = torch.tensor(blocks[:used], dtype=torch.int32, device="cpu")
        d = self._device
        d.slot_mapping[:t].copy_(h.slot_mapping[:t], non_blocking=True)
        d.token_seq[:t].copy_(h.token_seq[:t], non_blocking=True)
        d.token_pos[:t].copy_(h.token_pos[:t], non_blocking=True)
        d.block_table[:rows].copy_(h.block_table[:rows], non_blocking=True)


class TritonAttentionBackend:
    """Paged attention by one Triton kernel per layer (CUDA; Triton's interpreter on CPU)."""

    name = "triton"
    # Each program reads its own token's position and request, never a longest query, so a
    # captured step holds any mix of chunks (engine/execution/graph_buckets.choose_bucket).
    any_query_len = True

    def workspace_bytes(self, model_config: ModelConfig, itemsize: int, max_len: int) -> int:
        """The most bytes of split partials a layer holds at once (engine/execution/kv_plan.py):
        the largest step that splits, over contexts of up to max_len keys."""
        cfg = model_config
        tokens = split_tokens(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, max_len)
        return tokens * partial_bytes(cfg.num_heads, cfg.head_dim, max_len)

    def allocate_static_metadata(
        self, max_tokens: int, max_blocks_per_seq: int, block_size: int, device: torch.device
    ) -> StaticTritonMetadata:
        """Fixed metadata tensors for CUDA graphs (engine.execution.cuda_graphs.GraphableBackend)."""
        return StaticTritonMetadata(max_tokens, max_blocks_per_seq, block_size, device)

    def build_metadata(self, layout: BatchLayout, device: torch.device) -> TritonAttentionMetadata:
        token_seq, token_pos = token_positions(layout)
        # Built on the host, moved by to_device: pinned and non-blocking on CUDA.
        return TritonAttentionMetadata(
            slot_mapping=to_device(layout.slot_mapping, device),
            token_seq=to_device(token_seq, device),
            token_pos=to_device(token_pos, device),
            block_table=to_device(padded_block_table(layout), device),
            max_seq_len=max(layout.seq_lens),
        )

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        metadata: TritonAttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Write this step's K/V into the cache, then attend. `sliding_window`: a query at
        position p sees keys p - sliding_window + 1 .. p only (None: all of 0 .. p)."""
        write_kv(k_cache, v_cache, key, value, metadata.slot_mapping)
        return paged_attention(query, k_cache, v_cache, metadata, scale, sliding_window)

    def attend_written(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: TritonAttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Attend over caches that already hold this step's K/V: the fused layer path wrote
        them with RoPE in one launch (engine/kernels/triton_layer.py rope_write_kv)."""
        return paged_attention(query, k_cache, v_cache, metadata, scale)


def num_partitions(max_seq_len: int, window: int = NO_WINDOW) -> int:
    """The most partitions a token whose context has at most `max_seq_len` keys (and sees at
    most `window` of them) has keys in: its grid's partition dimension."""
    spans = -(-max(max_seq_len, 1) // PARTITION)
    # A window of w keys ending anywhere touches at most ceil((w - 1) / PARTITION) + 1 of them.
    return min(spans, -(-(window - 1) // PARTITION) + 1)


def partial_bytes(num_heads: int, head_dim: int, max_seq_len: int) -> int:
    """Scratch bytes of one token's partials: per query head and partition, head_dim weighted-V
    sums, a max and a sum, in float32."""
    return num_heads * num_partitions(max_seq_len) * (head_dim + 2) * 4


def split_tokens(num_heads: int, num_kv_heads: int, head_dim: int, max_seq_len: int) -> int:
    """The most tokens a step may have and still take the split path: fewer programs than
    SPLIT_BELOW_PROGRAMS without splitting, and partials within SPLIT_SCRATCH_BYTES (0 where a
    context fits one partition: nothing to split)."""
    if num_partitions(max_seq_len) <= 1:
        return 0
    by_programs = -(-SPLIT_BELOW_PROGRAMS // num_kv_heads) - 1
    return min(by_programs, SPLIT_SCRATCH_BYTES // partial_bytes(num_heads, head_dim, max_seq_len))


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    metadata: TritonAttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    *,
    split: bool | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Attention of every query token over its cached context (K/V already written): one launch,
    or the split path's two (the module's "Split contexts"). `split`: None chooses by the step
    (`split_tokens`); True or False forces a path (the bits are the same either way)."""
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert num_heads % num_kv_heads == 0, "GQA needs whole groups of query heads"
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1
    assert sliding_window is None or sliding_window > 0
    query = query if query.stride(2) == 1 else query.contiguous()
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_tokens == 0:
        return out
    window = sliding_window or NO_WINDOW
    if split is None:
        limit = split_tokens(num_heads, num_kv_heads, head_dim, metadata.max_seq_len)
        split = num_tokens <= limit
    group = num_heads // num_kv_heads
    shapes = dict(
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_H=max(MIN_DOT_DIM, triton.next_power_of_2(group)),
        BLOCK_D=max(MIN_DOT_DIM, triton.next_power_of_2(head_dim)),
        BLOCK_N=BLOCK_N,
        PARTITION=PARTITION,
        IS_FP32=query.dtype == torch.float32,
        num_warps=NUM_WARPS,
    )
    context = (
        metadata.token_seq,
        metadata.token_pos,
        metadata.block_table,
        scale * 1.4426950408889634,  # log2(e): the kernels take exp2
        window,
        block_size,
        query.stride(0),
        query.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        metadata.block_table.stride(0),
    )
    if not split:
        paged_attention_kernel[(num_tokens, num_kv_heads)](
            query, k_cache, v_cache, out, out.stride(0), out.stride(1), *context, **shapes
        )
        return out
    parts = num_partitions(metadata.max_seq_len, window)
    # [num_tokens, num_heads, parts, head_dim] weighted-V sums and [..., parts, 2] (max, sum).
    acc = torch.empty(
        num_tokens, num_heads, parts, head_dim, dtype=torch.float32, device=out.device
    )
    stats = torch.empty(num_tokens, num_heads, parts, 2, dtype=torch.float32, device=out.device)
    assert acc.stride(2) == head_dim and stats.stride(2) == 2
    partial_attention_kernel[(num_tokens, num_kv_heads, parts)](
        query,
        k_cache,
        v_cache,
        acc,
        stats,
        acc.stride(0),
        acc.stride(1),
        stats.stride(0),
        stats.stride(1),
        *context,
        **shapes,
    )
    merge_partials_kernel[(num_tokens, num_kv_heads)](
        acc,
        stats,
        out,
        metadata.token_pos,
        window,
        acc.stride(0),
        acc.stride(1),
        stats.stride(0),
        stats.stride(1),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_H=shapes["BLOCK_H"],
        BLOCK_D=shapes["BLOCK_D"],
        PARTITION=PARTITION,
        num_warps=NUM_WARPS,
    )
    return out
