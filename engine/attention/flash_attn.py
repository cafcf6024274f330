"""GPU paged attention through flash-attn's varlen kernel with a block table.

Imported only when chosen (the registry imports this module lazily), so CPU machines never need
flash-attn. flash-attn 2 reads the paged cache directly when given `block_table`; its causal mask
is aligned to the bottom right, which is exactly "each query token sees its own context": the
semantics of the torch backend. flash-attn 2 requires the page size to be a multiple of 256 (the
engine configuration refuses other block sizes at start-up; the kernel would refuse them too).

Two forms of metadata feed the same `forward`:
- eager (`build_metadata`): fresh tensors shaped to the step;
- static (`allocate_static_metadata`), for CUDA graphs: tensors at fixed addresses sized for the
  largest captured step, refilled in place before every replay. A graph replays the kernel
  launches it captured, with the same pointers and the same host-side arguments, so everything
  the kernel reads per step must live in those tensors, and the host-side ints (max_seqlen_q,
  max_seqlen_k, the number of sequence entries) are fixed when the graph is captured.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.attention.base import BatchLayout, write_kv
from engine.runtime.device import to_device

PAGE_SIZE_MULTIPLE = 256


@dataclass(frozen=True)
class FlashAttentionMetadata:
    """Cumulative offsets and the padded block table for one step."""

    slot_mapping: torch.Tensor  # [num_tokens] int64
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32
    cu_seqlens_k: torch.Tensor  # [num_seqs + 1] int32
    max_seqlen_q: int
    max_seqlen_k: int
    block_table: torch.Tensor  # [num_seqs, max_blocks] int32


class FlashAttentionBackend:
    """flash_attn_varlen_func over the paged cache (CUDA only)."""

    name = "flash_attn"

    def __init__(self, varlen: Callable[..., torch.Tensor] | None = None) -> None:
        """`varlen`: the kernel, called as flash_attn_varlen_func; None imports flash-attn's (tests
        pass a plain-torch reference to run this backend's logic on CPU)."""
        if varlen is None:
            from flash_attn import flash_attn_varlen_func

            varlen = flash_attn_varlen_func
        self._varlen = varlen

    def build_metadata(self, layout: BatchLayout, device: torch.device) -> FlashAttentionMetadata:
        assert layout.block_size % PAGE_SIZE_MULTIPLE == 0, "checked by the engine configuration"
        q_lens = torch.tensor(layout.query_lens, dtype=torch.int32, device="cpu")
        k_lens = torch.tensor(layout.seq_lens, dtype=torch.int32, device="cpu")
        max_blocks = max(len(t) for t in layout.block_tables)
        table = torch.zeros(layout.num_reqs, max_blocks, dtype=torch.int32, device="cpu")
        for i, blocks in enumerate(layout.block_tables):
            table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32, device="cpu")
        zero = torch.zeros(1, dtype=torch.int32, device="cpu")
        # Built on the host, moved by to_device: pinned and non-blocking on CUDA, so the step's
        # metadata never waits for the device (a pageable .to(device) would).
        return FlashAttentionMetadata(
            slot_mapping=to_device(layout.slot_mapping, device),
            cu_seqlens_q=to_device(torch.cat([zero, q_lens.cumsum(0, dtype=torch.int32)]), device),
            cu_seqlens_k=to_device(torch.cat([zero, k_lens.cumsum(0, dtype=torch.int32)]), device),
            max_seqlen_q=max(layout.query_lens),
            max_seqlen_k=max(layout.seq_lens),
            block_table=to_device(table, device),
        )

    def allocate_static_metadata(
        self, max_tokens: int, max_blocks_per_seq: int, block_size: int, device: torch.device
    ) -> StaticFlashMetadata:
        """Metadata storage for CUDA graphs of up to `max_tokens` tokens (see the class)."""
        assert block_size % PAGE_SIZE_MULTIPLE == 0, "checked by the engine configuration"
        return StaticFlashMetadata(max_tokens, max_blocks_per_seq, block_size, device)

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
        write_kv(k_cache, v_cache, key, value, metadata.slot_mapping)
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


@dataclass(frozen=True)
class _MetadataTensors:
    slot_mapping: torch.Tensor  # [max_tokens] int64
    cu_seqlens_q: torch.Tensor  # [max_tokens + 1] int32
    cu_seqlens_k: torch.Tensor  # [max_tokens + 1] int32
    block_table: torch.Tensor  # [max_tokens, max_blocks_per_seq] int32

    @classmethod
    def allocate(
        cls, max_tokens: int, max_blocks: int, device: torch.device, pin: bool
    ) -> _MetadataTensors:
        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin)

        return cls(
            slot_mapping=zeros(max_tokens, dtype=torch.int64),
            cu_seqlens_q=zeros(max_tokens + 1, dtype=torch.int32),
            cu_seqlens_k=zeros(max_tokens + 1, dtype=torch.int32),
            block_table=zeros(max_tokens, max_blocks, dtype=torch.int32),
        )


class StaticFlashMetadata:
    """flash-attn metadata at fixed addresses, for steps padded to a captured token count.

    A graph captured for T tokens launches the kernel with T sequence entries (cu_seqlens of
    T + 1) and fixed max_seqlen_q / max_seqlen_k. A step of n <= T real tokens in r sequences is
    laid out as:
    - entries 0 .. r-1: the real sequences (their query and context lengths, their blocks);
    - one entry per padded token (T - n of them): one query over a one-key context, slot 0 of
      `pad_block` (a block no request owns); padded token j writes its K/V to slot j mod
      block_size of that block, so padding never touches a real request's cache;
    - the entries left (n - r: a verify step has more tokens than sequences) are empty: zero
      query and zero key tokens, which the kernel skips (a row block past a sequence's query
      length returns at once).
    Every token belongs to exactly one entry, so every output row is computed. A decode step
    (n == r) has no empty entry and, captured with max_seqlen_q 1, takes flash-attn's
    single-query path, which needs exactly one query token per entry.

    Host copies go through pinned mirrors of the device tensors and do not block the host: the
    caller must not refill before the previous refill's copies have run (CudaGraphs fences them).
    """

    def __init__(
        self, max_tokens: int, max_blocks_per_seq: int, block_size: int, device: torch.device
    ) -> None:
        self.max_tokens = max_tokens
        self.max_blocks_per_seq = max_blocks_per_seq
        self.block_size = block_size
        is_cuda = device.type == "cuda"
        self._host = _MetadataTensors.allocate(
            max_tokens, max_blocks_per_seq, torch.device("cpu"), pin=is_cuda
        )
        self._device = _MetadataTensors.allocate(max_tokens, max_blocks_per_seq, device, pin=False)

    def view(self, num_tokens: int, max_seqlen_q: int, max_seqlen_k: int) -> FlashAttentionMetadata:
        """The metadata a graph of `num_tokens` tokens captures: prefixes of the fixed tensors."""
        assert 1 <= num_tokens <= self.max_tokens
        d = self._device
        return FlashAttentionMetadata(
            slot_mapping=d.slot_mapping[:num_tokens],
            cu_seqlens_q=d.cu_seqlens_q[: num_tokens + 1],
            cu_seqlens_k=d.cu_seqlens_k[: num_tokens + 1],
            max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k,
            block_table=d.block_table[:num_tokens],
        )

    def fill(self, layout: BatchLayout, num_tokens: int, pad_block: int) -> None:
        """Lay out `layout` (the real step) padded to `num_tokens` tokens, as the class says,
        and copy it into the device tensors (non-blocking from pinned memory on CUDA)."""
        bs, n, r, t = self.block_size, layout.num_tokens, layout.num_reqs, num_tokens
        assert layout.block_size == bs and n <= t <= self.max_tokens
        num_pad = t - n
        h = self._host
        h.slot_mapping[:n].copy_(layout.slot_mapping)
        pad_slots = torch.arange(num_pad, dtype=torch.int64, device="cpu") % bs + pad_block * bs
        h.slot_mapping[n:t].copy_(pad_slots)
        num_empty = t - r - num_pad
        q_lens = [*layout.query_lens, *[1] * num_pad, *[0] * num_empty]
        k_lens = [*layout.seq_lens, *[1] * num_pad, *[0] * num_empty]
        h.cu_seqlens_q[1 : t + 1].copy_(torch.tensor(q_lens, device="cpu").cumsum(0))
        h.cu_seqlens_k[1 : t + 1].copy_(torch.tensor(k_lens, device="cpu").cumsum(0))
        table = h.block_table
        table[:t].fill_(pad_block)
        for i, (blocks, seq_len) in enumerate(
            zip(layout.block_tables, layout.seq_lens, strict=True)
        ):
            used = -(-seq_len // bs)
            assert used <= self.max_blocks_per_seq and used <= len(blocks)
            table[i, :used] = torch.tensor(blocks[:used], dtype=torch.int32, device="cpu")
        d = self._device
        d.slot_mapping[:t].copy_(h.slot_mapping[:t], non_blocking=True)
        d.cu_seqlens_q[: t + 1].copy_(h.cu_seqlens_q[: t + 1], non_blocking=True)
        d.cu_seqlens_k[: t + 1].copy_(h.cu_seqlens_k[: t + 1], non_blocking=True)
        d.block_table[:t].copy_(table[:t], non_blocking=True)
