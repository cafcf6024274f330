"""`GrammarState`: one sequence's position in its compiled grammar.

Token masks are xgrammar's packed bitmasks: int32 words, bit b of word w allows token 32 w + b.
`unpack_masks` turns rows of them into a boolean [rows, vocab] mask with plain torch on any
device, so the sampler needs no grammar library.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def mask_width(vocab_size: int) -> int:
    """int32 words per packed mask row."""
    return (vocab_size + 31) // 32


def new_masks(num_rows: int, vocab_size: int) -> torch.Tensor:
    """[num_rows, mask_width] int32 on the host, every token allowed."""
    return torch.full((num_rows, mask_width(vocab_size)), -1, dtype=torch.int32)


def unpack_masks(packed: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """packed [n, words] int32 -> [n, vocab_size] bool, True where the token is allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=packed.device)  # [32]
    bits = (packed.unsqueeze(-1) >> shifts) & 1  # [n, words, 32]
    return bits.view(packed.shape[0], -1)[:, :vocab_size].bool()


class GrammarState:
    """A matcher over one compiled grammar that follows a sequence's output token by token."""

    def __init__(self, compiled: Any, vocab_size: int) -> None:
        import xgrammar

        self._matcher = xgrammar.GrammarMatcher(compiled)
        self.vocab_size = vocab_size

    @property
    def is_terminated(self) -> bool:
        """The grammar accepted a stop token: nothing may follow."""
        return bool(self._matcher.is_terminated())

    def fill_mask(self, masks: torch.Tensor, index: int) -> None:
        """Write the tokens allowed next into row `index` of host masks [n, words] int32."""
        self._matcher.fill_next_token_bitmask(masks, index)

    def accept(self, token_id: int) -> bool:
        """Advance by one token; False (and no change) if the grammar forbids it."""
        return bool(self._matcher.accept_token(int(token_id)))

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._matcher.rollback(num_tokens)

    def num_allowed(self, token_ids: Sequence[int]) -> int:
        """How many of token_ids, in order, the grammar allows from here (state unchanged)."""
        num = 0
        for token_id in token_ids:
            if self.is_terminated or not self.accept(token_id):
                break
            num += 1
        self.rollback(num)
        return num

    def forced_text(self) -> str:
        """The text the grammar allows exactly one way to continue with from here (keys of a
        schema, punctuation, closing brackets, the rest of an enum's only match), or ""."""
        if self.is_terminated:
            return ""
        return str(self._matcher.find_jump_forward_string())
