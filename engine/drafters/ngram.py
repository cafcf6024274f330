"""Prompt lookup decoding: draft the tokens that followed an earlier occurrence of the context's
last n tokens.

For n from `prompt_lookup_max` down to `prompt_lookup_min`, the last n tokens of
`request.all_token_ids` (prompt and output) are looked up among the earlier n-grams of the same
sequence; the first hit proposes up to max_length tokens that followed it. Longest n wins; among
occurrences of one n-gram the EARLIEST wins. Because a continuation is only cut short by the end of
the context, the earliest occurrence is also the one with the longest available continuation, so
"earliest" and "longest continuation" never disagree.

The index is incremental: per request and per n a dict from n-gram to the position right after its
first occurrence, extended with only the tokens appended since the last call. Contract assumed of
the request: tokens are only appended at the end or truncated from the end. A shorter sequence or
a changed tail of the indexed part (preemption, stop-string truncation) rebuilds that request's
index; the check compares the indexed length and the last few indexed tokens, not the whole list.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.core.drafts import Draft
from engine.core.request import Request
from engine.drafters.proposer import LookupProposer

NgramIndex = dict[tuple[int, ...], int]
# Extensions shorter than this (a decode or verify step's tokens) are indexed one n-gram at a
# time; longer ones (a prompt, a rebuild) through n shifted views zipped together.
SHORT_EXTENSION = 16


def index_ngrams(
    index: NgramIndex, token_ids: Sequence[int], n: int, first_end: int, last_end: int
) -> None:
    """Insert the n-grams token_ids[e - n:e] for e in [first_end, last_end] -> e, keeping an
    existing (earlier) position when the n-gram is already there."""
    first_end = max(first_end, n)
    if first_end > last_end:
        return
    setdefault = index.setdefault
    if last_end - first_end < SHORT_EXTENSION:  # a step's few tokens: no views to build
        for end in range(first_end, last_end + 1):
            setdefault(tuple(token_ids[end - n : end]), end)
        return
    start = first_end - n
    # n shifted views zipped together yield every n-gram in one C-level pass (fast on rebuilds).
    columns = [token_ids[start + j : last_end - n + j + 1] for j in range(n)]
    for end, key in enumerate(zip(*columns, strict=True), start=first_end):
        setdefault(key, end)


@dataclass
class _NgramState:
    """One request's index: ngram_index[n - min_n] maps an n-gram to where its first copy ended."""

    ngram_index: list[NgramIndex]
    num_indexed: int = 0
    tail_token_ids: tuple[int, ...] = field(default_factory=tuple)  # last indexed tokens


class NgramProposer(LookupProposer):
    """Prompt lookup decoding over the request's own prompt and output tokens."""

    name = "ngram"

    def __init__(self, prompt_lookup_max: int = 4, prompt_lookup_min: int = 2) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                "need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"min={prompt_lookup_min}, max={prompt_lookup_max}."
            )
        self.prompt_lookup_max = prompt_lookup_max
        self.prompt_lookup_min = prompt_lookup_min
        super().__init__()
        self._states: dict[str, _NgramState] = {}

    def _propose_one(self, request: Request, max_length: int) -> Draft | None:
        if max_length <= 0:
            return None  # the index catches up on the next call that wants a draft
        token_ids = request.all_token_ids
        state = self._update_index(request.request_id, token_ids)
        num_tokens = len(token_ids)
        min_n = self.prompt_lookup_min
        for n in range(min(self.prompt_lookup_max, num_tokens - 1), min_n - 1, -1):
            end = state.ngram_index[n - min_n].get(tuple(token_ids[num_tokens - n :]))
            # end == num_tokens means the only copy of the n-gram is the suffix itself.
            if end is not None and end < num_tokens:
                return Draft(token_ids=tuple(token_ids[end : end + max_length]), source=self.name)
        return None

    def _update_index(self, request_id: str, token_ids: list[int]) -> _NgramState:
        state = self._states.get(request_id)
        num_tokens = len(token_ids)
        if state is None or not self._is_prefix_intact(state, token_ids):
            num_ngram_sizes = self.prompt_lookup_max - self.prompt_lookup_min + 1
            state = _NgramState(ngram_index=[{} for _ in range(num_ngram_sizes)])
            self._states[request_id] = state
        if num_tokens > state.num_indexed:
            for i, index in enumerate(state.ngram_index):
                n = self.prompt_lookup_min + i
                index_ngrams(index, token_ids, n, state.num_indexed + 1, num_tokens)
            state.num_indexed = num_tokens
            state.tail_token_ids = tuple(token_ids[-self.prompt_lookup_max :])
        return state

    @staticmethod
    def _is_prefix_intact(state: _NgramState, token_ids: list[int]) -> bool:
        """Cheap check that the indexed part is still there: length and last few tokens."""
        num_indexed = state.num_indexed
        if len(token_ids) < num_indexed:
            return False
        num_tail = len(state.tail_token_ids)
        return tuple(token_ids[num_indexed - num_tail : num_indexed]) == state.tail_token_ids
