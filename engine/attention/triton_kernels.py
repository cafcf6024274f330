"""The Triton paged-attention kernels (engine/attention/triton_attn.py launches them and says
what they compute): the one-launch kernel, and the split path's partials and their merge, which
share `_attend_partition` and `_merge` so a token's bits do not depend on the path."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _dot(a, b, IS_FP32: tl.constexpr):
    """a @ b accumulated in float32. Float32 operands multiply in full float32 ("ieee"): NVIDIA's
    default would round them to TF32 (10-bit mantissas), far from the float32 reference.
    16-bit operands keep the default (exact products on the tensor cores)."""
    return tl.dot(a, b, input_precision="ieee") if IS_FP32 else tl.dot(a, b)


@triton.jit
def _merge(m, row_sum, acc, part_m, part_sum, part_acc):
    """The running softmax state (m, row_sum, acc) with one more partition's partial merged in:
    both rescaled to the larger max. From the empty state (m = -inf, zeros) the result is the
    partial itself, exactly."""
    m_new = tl.maximum(m, part_m)
    alpha = tl.exp2(m - m_new)  # [BLOCK_H]
    beta = tl.exp2(part_m - m_new)  # [BLOCK_H]
    row_sum = row_sum * alpha + part_sum * beta
    acc = acc * alpha[:, None] + part_acc * beta[:, None]
    return m_new, row_sum, acc


@triton.jit
def _load_query(
    q_ptr, tok, kv_head, stride_q_tok, stride_q_head, GROUP, HEAD_DIM, BLOCK_H, BLOCK_D
):
    """[BLOCK_H, BLOCK_D]: the query heads of `kv_head`'s group for token `tok` (zero padded)."""
    rows = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    q_offsets = tok * stride_q_tok + (kv_head * GROUP + rows)[:, None] * stride_q_head
    q_mask = (rows < GROUP)[:, None] & (dims < HEAD_DIM)[None, :]
    return tl.load(q_ptr + q_offsets + dims[None, :], mask=q_mask, other=0.0)


@triton.jit
def _attend_partition(
    q,  # [BLOCK_H, BLOCK_D]
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    seq,
    kv_head,
    pos,
    first,  # the first key the token sees
    part_start,  # the partition's first position (a multiple of PARTITION)
    scale_log2e,
    block_size,
    stride_c_block,
    stride_c_slot,
    stride_c_head,
    stride_bt_seq,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PARTITION: tl.constexpr,
    IS_FP32: tl.constexpr,
):
    """One partition's partial, (max, sum of exp2, sum of exp2 * V) over its keys the token
    sees, by an online softmax over its tiles in increasing order from a fresh state."""
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max of the scaled scores
    row_sum = tl.zeros([BLOCK_H], tl.float32)  # running sum of exp2(score - m)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)  # running sum of exp2(score - m) * V
    # Tiles are BLOCK_N-aligned: the first is the one holding `first` (or the partition's own
    # first), so every real row sees a key in it and m is finite from then on (padding rows of
    # q are zeros, also finite).
    lo = tl.maximum(part_start, first // BLOCK_N * BLOCK_N)
    hi = tl.minimum(part_start + PARTITION, pos + 1)
    for start in range(lo, hi, BLOCK_N):
        key_pos = start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        in_context = key_pos <= pos
        visible = in_context & (key_pos >= first)
        block = tl.load(
            block_table_ptr + seq * stride_bt_seq + key_pos // block_size, mask=in_context, other=0
        ).to(tl.int64)  # [BLOCK_N]
        slot = block * stride_c_block + (key_pos % block_size) * stride_c_slot
        kv_offsets = (slot + kv_head * stride_c_head)[:, None] + dims[None, :]
        kv_mask = visible[:, None] & dim_ok[None, :]  # [BLOCK_N, BLOCK_D]
        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        scores = _dot(q, tl.trans(k), IS_FP32) * scale_log2e  # [BLOCK_H, BLOCK_N]
        scores = tl.where(visible[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        alpha = tl.exp2(m - m_new)  # [BLOCK_H]: rescales what was summed under the old max
        p = tl.exp2(scores - m_new[:, None])  # [BLOCK_H, BLOCK_N]
        row_sum = row_sum * alpha + tl.sum(p, 1)
        pv = _dot(p.to(v.dtype), v, IS_FP32)  # [BLOCK_H, BLOCK_D]
        acc = acc * alpha[:, None] + pv
        m = m_new
    return m, row_sum, acc


@triton.jit
def paged_attention_kernel(
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # same strides as k_cache
    out_ptr,  # [num_tokens, num_heads, head_dim]
    stride_o_tok,
    stride_o_head,
    token_seq_ptr,  # [num_tokens] int32
    token_pos_ptr,  # [num_tokens] int32
    block_table_ptr,  # [num_seqs, max_blocks] int32
    scale_log2e,  # softmax scale * log2(e)
    window,  # a query at position p sees keys p - window + 1 .. p
    block_size,
    stride_q_tok,
    stride_q_head,
    stride_c_block,
    stride_c_slot,
    stride_c_head,
    stride_bt_seq,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,  # GROUP padded to a power of two >= 16
    BLOCK_D: tl.constexpr,  # HEAD_DIM padded to a power of two >= 16
    BLOCK_N: tl.constexpr,  # key positions per tile
    PARTITION: tl.constexpr,  # key positions per partition
    IS_FP32: tl.constexpr,  # q and the caches are float32
):
    """One program per (token, KV head): the token's partitions in order, merged as they end."""
    tok = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    seq = tl.load(token_seq_ptr + tok).to(tl.int64)
    pos = tl.load(token_pos_ptr + tok)
    q = _load_query(
        q_ptr, tok, kv_head, stride_q_tok, stride_q_head, GROUP, HEAD_DIM, BLOCK_H, BLOCK_D
    )
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    first = tl.maximum(pos - window + 1, 0)
    for part_start in range(first // PARTITION * PARTITION, pos + 1, PARTITION):
        part_m, part_sum, part_acc = _attend_partition(
            q,
            k_cache_ptr,
            v_cache_ptr,
            block_table_ptr,
            seq,
            kv_head,
            pos,
            first,
            part_start,
            scale_log2e,
            block_size,
            stride_c_block,
            stride_c_slot,
            stride_c_head,
            stride_bt_seq,
            HEAD_DIM,
            BLOCK_H,
            BLOCK_D,
            BLOCK_N,
            PARTITION,
            IS_FP32,
        )
        m, row_sum, acc = _merge(m, row_sum, acc, part_m, part_sum, part_acc)
    out = acc / row_sum[:, None]
    rows = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    o_offsets = tok * stride_o_tok + (kv_head * GROUP + rows)[:, None] * stride_o_head
    o_mask = (rows < GROUP)[:, None] & (dims < HEAD_DIM)[None, :]
    tl.store(out_ptr + o_offsets + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def partial_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    acc_ptr,  # [num_tokens, num_heads, parts, head_dim] float32
    stats_ptr,  # [num_tokens, num_heads, parts, 2] float32: (max, sum)
    stride_a_tok,
    stride_a_head,
    stride_s_tok,
    stride_s_head,
    token_seq_ptr,
    token_pos_ptr,
    block_table_ptr,
    scale_log2e,
    window,
    block_size,
    stride_q_tok,
    stride_q_head,
    stride_c_block,
    stride_c_slot,
    stride_c_head,
    stride_bt_seq,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PARTITION: tl.constexpr,
    IS_FP32: tl.constexpr,
):
    """One program per (token, KV head, partition index z): the partial of the token's z-th
    partition (counted from the one holding its first key), or nothing past its last."""
    tok = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    z = tl.program_id(2)
    pos = tl.load(token_pos_ptr + tok)
    first = tl.maximum(pos - window + 1, 0)
    part_start = (first // PARTITION + z) * PARTITION
    if part_start <= pos:
        seq = tl.load(token_seq_ptr + tok).to(tl.int64)
        q = _load_query(
            q_ptr, tok, kv_head, stride_q_tok, stride_q_head, GROUP, HEAD_DIM, BLOCK_H, BLOCK_D
        )
        part_m, part_sum, part_acc = _attend_partition(
            q,
            k_cache_ptr,
            v_cache_ptr,
            block_table_ptr,
            seq,
            kv_head,
            pos,
            first,
            part_start,
            scale_log2e,
            block_size,
            stride_c_block,
            stride_c_slot,
            stride_c_head,
            stride_bt_seq,
            HEAD_DIM,
            BLOCK_H,
            BLOCK_D,
            BLOCK_N,
            PARTITION,
            IS_FP32,
        )
        rows = tl.arange(0, BLOCK_H)
        dims = tl.arange(0, BLOCK_D)
        row_ok = rows < GROUP
        heads = (kv_head * GROUP + rows).to(tl.int64)
        a_offsets = tok * stride_a_tok + heads * stride_a_head + z * HEAD_DIM  # [BLOCK_H]
        a_mask = row_ok[:, None] & (dims < HEAD_DIM)[None, :]
        tl.store(acc_ptr + a_offsets[:, None] + dims[None, :], part_acc, mask=a_mask)
        s_offsets = tok * stride_s_tok + heads * stride_s_head + z * 2  # [BLOCK_H]
        tl.store(stats_ptr + s_offsets, part_m, mask=row_ok)
        tl.store(stats_ptr + s_offsets + 1, part_sum, mask=row_ok)


@triton.jit
def merge_partials_kernel(
    acc_ptr,  # [num_tokens, num_heads, parts, head_dim] float32
    stats_ptr,  # [num_tokens, num_heads, parts, 2] float32
    out_ptr,  # [num_tokens, num_heads, head_dim]
    token_pos_ptr,
    window,
    stride_a_tok,
    stride_a_head,
    stride_s_tok,
    stride_s_head,
    stride_o_tok,
    stride_o_head,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PARTITION: tl.constexpr,
):
    """One program per (token, KV head): the token's partials merged in increasing order by
    `_merge`, as `paged_attention_kernel` merges them."""
    tok = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    pos = tl.load(token_pos_ptr + tok)
    first = tl.maximum(pos - window + 1, 0)
    num_parts = pos // PARTITION - first // PARTITION + 1
    rows = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < GROUP
    mask = row_ok[:, None] & (dims < HEAD_DIM)[None, :]
    heads = (kv_head * GROUP + rows).to(tl.int64)
    base = tok * stride_a_tok + heads * stride_a_head  # [BLOCK_H]
    stats = tok * stride_s_tok + heads * stride_s_head  # [BLOCK_H]
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for z in range(0, num_parts):
        part_acc = tl.load(
            acc_ptr + (base + z * HEAD_DIM)[:, None] + dims[None, :], mask=mask, other=0.0
        )
        # Padding rows merge zeros with a max of 0 and a sum of 1: finite, and never stored.
        part_m = tl.load(stats_ptr + stats + z * 2, mask=row_ok, other=0.0)
        part_sum = tl.load(stats_ptr + stats + z * 2 + 1, mask=row_ok, other=1.0)
        m, row_sum, acc = _merge(m, row_sum, acc, part_m, part_sum, part_acc)
    out = acc / row_sum[:, None]
    o_offsets = tok * stride_o_tok + heads[:, None] * stride_o_head
    tl.store(out_ptr + o_offsets + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)
