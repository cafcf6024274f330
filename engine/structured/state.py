"""`GrammarState`: one sequence's position in its compiled grammar (masks: see `masks`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.structured.compiler import CompiledGrammar


class GrammarState:
    """A matcher over one compiled grammar that follows a sequence's output token by token."""

    def __init__(self, compiled: CompiledGrammar, vocab_size: int) -> None:
        import xgrammar

        self._matcher = xgrammar.GrammarMatcher(compiled.grammar)
        self._allowed = compiled.allowed  # [words] int32: what no grammar lets through is out
        self.vocab_size = vocab_size

    @property
    def is_terminated(self) -> bool:
        """The grammar accepted a stop token: nothing may follow."""
        return bool(self._matcher.is_terminated())

    def fill_mask(self, masks: torch.Tensor, index: int) -> None:
        """Write the tokens allowed next into row `index` of host masks [n, words] int32."""
        self._matcher.fill_next_token_bitmask(masks, index)
        masks[index] &= self._allowed

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
