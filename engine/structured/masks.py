"""Token masks of grammar rows, and applying them to logits.

Masks are xgrammar's packed bitmasks: int32 words, bit b of word w allows token 32 w + b. They are
filled on the host by the rows' grammar states; `unpack_masks` turns them into a boolean
[rows, vocab] mask with plain torch on the logits' device, so the sampler needs no grammar
library.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.runtime.device import to_device

_NEG_INF = float("-inf")


@dataclass(frozen=True)
class TokenMasks:
    """Grammar masks of some rows of a batch."""

    row_ids: list[int]  # the masked rows, ascending
    packed: torch.Tensor  # [len(row_ids), mask_width(vocab)] int32, on the host

    def __post_init__(self) -> None:
        assert self.packed.dim() == 2 and self.packed.shape[0] == len(self.row_ids)


def mask_width(vocab_size: int) -> int:
    """int32 words per packed mask row."""
    return (vocab_size + 31) // 32


def new_masks(num_rows: int, vocab_size: int) -> torch.Tensor:
    """[num_rows, mask_width] int32 on the host, every token allowed."""
    return torch.full((num_rows, mask_width(vocab_size)), -1, dtype=torch.int32, device="cpu")


def pack_masks(allowed: torch.Tensor) -> torch.Tensor:
    """allowed [n, vocab_size] bool -> [n, mask_width] int32 on allowed's device (unpack_masks'
    inverse; ids past vocab_size in the last word are off)."""
    n, vocab_size = allowed.shape
    width = mask_width(vocab_size)
    bits = torch.zeros(n, width * 32, dtype=torch.int64, device=allowed.device)
    bits[:, :vocab_size] = allowed.to(torch.int64)
    shifts = torch.arange(32, dtype=torch.int64, device=allowed.device)  # [32]
    words = (bits.view(n, width, 32) << shifts).sum(dim=-1)  # [n, width], 0 .. 2**32 - 1
    return (words - (words >= 2**31).to(torch.int64) * 2**32).to(torch.int32)  # two's complement


def unpack_masks(packed: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """packed [n, words] int32 -> [n, vocab_size] bool, True where the token is allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=packed.device)  # [32]
    bits = (packed.unsqueeze(-1) >> shifts) & 1  # [n, words, 32]
    return bits.view(packed.shape[0], -1)[:, :vocab_size].bool()


def apply_masks(logits: torch.Tensor, masks: TokenMasks) -> None:
    """Set the tokens each masked row's grammar forbids to -inf, in place (logits [n, vocab])."""
    device, vocab_size = logits.device, logits.shape[1]
    idx = to_device(torch.tensor(masks.row_ids, dtype=torch.int64, device="cpu"), device)
    allowed = unpack_masks(to_device(masks.packed, device), vocab_size)  # [n, vocab_size]
    logits[idx] = logits[idx].masked_fill(~allowed, _NEG_INF)


def let_grammar_end(logits: torch.Tensor, idx: torch.Tensor, before_ban: torch.Tensor) -> None:
    """Rows that a min_tokens ban left without any token take back their grammar-masked logits
    (before_ban [n, vocab] of rows idx [n]): where a document is complete, the grammar wins."""
    banned = logits[idx]  # [n, vocab_size]
    is_empty = torch.isneginf(banned).all(dim=-1, keepdim=True)  # [n, 1]
    logits[idx] = torch.where(is_empty, before_ban, banned)
