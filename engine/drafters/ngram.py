"""Prompt lookup decoding: draft the tokens that followed an earlier occurrence of the context's
last n tokens.

For n from `prompt_lookup_max` down to `prompt_lookup_min`, the last n tokens of
`request.all_token_ids` (prompt and output) are looked up among the earlier n-grams of the same
sequence; the first hit proposes up to max_length tokens that followed it. Longest n wins; among
occurrences of one n-gram the EARLIEST wins. Because a continuation is only cut short by the end of
the context, the earliest occurrence is also the one with the longest available continuation, so
"earliest" and "longest continuation" never disagree.

The index is incremental: per request, a dict from each `prompt_lookup_min`-gram (a token id
itself when that is 1) to the positions right after its copies, in increasing order, extended
with only the tokens appended since the last call: one list append a token, whatever the range
of n. A lookup walks the copies of the context's last min-gram in order and extends each match
backwards up to `prompt_lookup_max`: the first copy with the longest match is the answer above
(each n's earliest copy is among them, and the longest n wins), and a full-length match ends the
walk. Contract assumed of the request: tokens are only appended at the end or truncated from the
end. A shorter sequence or a changed tail of the indexed part (preemption, stop-string
truncation) rebuilds that request's index; the check compares the indexed length and the last
few indexed tokens, not the whole list.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from engine.core.drafts import Draft
from engine.core.request import Request
from engine.drafters.proposer import LookupProposer

# A min-gram (a token id when prompt_lookup_min is 1, else a tuple) -> the ends of its copies.
NgramPositions = dict[Hashable, list[int]]


def index_positions(
    positions: NgramPositions, token_ids: Sequence[int], n: int, first_end: int, last_end: int
) -> None:
    """Append e to the list of the n-gram token_ids[e - n:e] for e in [first_end, last_end]
    (increasing, so each list stays sorted); with n == 1 the key is the token id itself."""
    first_end = max(first_end, n)
    get = positions.get
    for end in range(first_end, last_end + 1):
        key: Hashable = token_ids[end - 1] if n == 1 else tuple(token_ids[end - n : end])
        ends = get(key)
        if ends is None:
            positions[key] = [end]
        else:
            ends.append(end)


@dataclass
class _NgramState:
    """One request's index: `positions` holds every min-gram ending at 1..num_indexed."""

    positions: NgramPositions = field(default_factory=dict)
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
        min_n, max_n = self.prompt_lookup_min, min(self.prompt_lookup_max, num_tokens - 1)
        if max_n < min_n:
            return None
        key = token_ids[-1] if min_n == 1 else tuple(token_ids[num_tokens - min_n :])
        ends = state.positions.get(key)
        if ends is None:
            return None
        best_length, best_end = 0, 0
        for end in ends:
            # end == num_tokens is the suffix itself (the last entry): no earlier copy.
            if end >= num_tokens:
                break
            length, limit = min_n, min(max_n, end)
            while length < limit and token_ids[end - 1 - length] == token_ids[-1 - length]:
                length += 1
            if length > best_length:
                best_length, best_end = length, end
                if length == max_n:
                    break
        if not best_length:
            return None
        return Draft(token_ids=tuple(token_ids[best_end : best_end + max_length]), source=self.name)

    def _update_index(self, request_id: str, token_ids: list[int]) -> _NgramState:
        state = self._states.get(request_id)
        num_tokens = len(token_ids)
        if state is None or not self._is_prefix_intact(state, token_ids):
            state = _NgramState()
            self._states[request_id] = state
        if num_tokens > state.num_indexed:
            n = self.prompt_lookup_min
            index_positions(state.positions, token_ids, n, state.num_indexed + 1, num_tokens)
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
