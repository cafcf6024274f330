"""The grammar as a draft source: text a request's grammar allows exactly one way to continue.

Under a JSON schema, keys, punctuation, closing brackets and the rest of an enum value once its
prefix is unique are forced: the grammar state names them (`GrammarState.forced_text`) before the
model is asked. This proposer drafts that text, tokenized as the tokenizer would, and cut where
the grammar forbids a token. The verifier masks every row with the grammar too, so where the
grammar allows one token only the target's masked distribution is all on it and the draft is
accepted with probability 1; where several tokenizations of the forced text are allowed, the
test decides as for any draft. Drafts cost no model forward: they are free.
"""

from __future__ import annotations

from typing import Any

from engine.core.drafts import Draft
from engine.core.request import Request
from engine.drafters.proposer import LookupProposer


class GrammarProposer(LookupProposer):
    """Drafts the forced continuation of requests under a grammar; None for the others."""

    name = "grammar"

    def __init__(self, tokenizer: Any) -> None:
        super().__init__()
        self._tokenizer = tokenizer  # the engine's: drafting runs on the engine thread

    def _propose_one(self, request: Request, max_length: int) -> Draft | None:
        state = request.grammar
        if state is None or self._tokenizer is None or max_length < 1:
            return None
        text = state.forced_text()
        if not text:
            return None
        token_ids = self._tokenizer.encode(text, add_special_tokens=False)[:max_length]
        num_allowed = state.num_allowed(token_ids)
        return Draft(tuple(token_ids[:num_allowed]), self.name) if num_allowed else None
