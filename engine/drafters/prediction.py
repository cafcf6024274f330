"""OpenAI Predicted Outputs as a draft source: the client's guess of the whole output.

Per request a small state machine walks the output tokens one by one against
`request.prediction_token_ids`:
- synced: the output has followed the prediction up to `pointer` (the position after the last
  matched prediction token); a token equal to prediction[pointer] advances it, any other token
  loses sync.
- not synced: after every output token, try to re-synchronise on the output's last n tokens
  (n from `max_match_len` down to `min_match_len`, OUTPUT tokens only): the longest n that occurs in
  the prediction wins; among its occurrences the first one ending at or after `pointer` is preferred,
  then the closest one before it. The pointer moves right after the occurrence.
Synced requests propose prediction[pointer:pointer + max_length]; the others propose nothing.

Since the state is a function of the output tokens alone, walking them one step at a time or all at
once gives the same pointer. Contract assumed of the request: output tokens are only appended or
truncated at the end; a shorter output or a changed last token replays the walk from the start.
The occurrence index (min_match_len-gram -> sorted end positions) is built at the first
re-synchronisation, so requests whose output never leaves the prediction never pay for it.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

from engine.core.drafts import Draft
from engine.core.request import Request
from engine.drafters.proposer import LookupProposer

# A very common min_match_len-gram in a long prediction can have hundreds of occurrences; the
# candidates nearest the pointer are the likely ones, so the scan stops after this many.
_MAX_RESYNC_CANDIDATES = 128


@dataclass
class _PredictionState:
    """Where one request's output stands in its prediction."""

    prediction_token_ids: tuple[int, ...]
    pointer: int = 0
    is_synced: bool = True
    num_processed: int = 0  # output tokens walked so far
    last_token_id: int = -1  # output[num_processed - 1], to notice a truncation
    occurrences: dict[tuple[int, ...], list[int]] | None = None  # built at the first resync


class PredictionProposer(LookupProposer):
    """Drafts the next tokens of the request's predicted output (OpenAI `prediction`)."""

    name = "prediction"

    def __init__(self, max_match_len: int = 8, min_match_len: int = 2) -> None:
        if not 1 <= min_match_len <= max_match_len:
            raise ValueError(
                "need 1 <= min_match_len <= max_match_len, got "
                f"min={min_match_len}, max={max_match_len}."
            )
        self.max_match_len = max_match_len
        self.min_match_len = min_match_len
        super().__init__()
        self._states: dict[str, _PredictionState] = {}

    def pointer(self, request: Request) -> int | None:
        """The request's position in its prediction, or None while it is out of sync."""
        state = self._states.get(request.request_id)
        if state is None or not state.is_synced:
            return None
        return state.pointer

    def _propose_one(self, request: Request, max_length: int) -> Draft | None:
        if max_length <= 0 or not request.prediction_token_ids:
            return None
        state = self._advance(request)
        if not state.is_synced or state.pointer >= len(state.prediction_token_ids):
            return None
        draft_ids = state.prediction_token_ids[state.pointer : state.pointer + max_length]
        return Draft(token_ids=draft_ids, source=self.name)

    def _advance(self, request: Request) -> _PredictionState:
        """Walk the output tokens appended since the last call."""
        output_ids = request.output_token_ids
        state = self._states.get(request.request_id)
        if (
            state is None
            or state.prediction_token_ids is not request.prediction_token_ids
            or len(output_ids) < state.num_processed
            or (state.num_processed and output_ids[state.num_processed - 1] != state.last_token_id)
        ):
            occurrences = None
            if state is not None and state.prediction_token_ids is request.prediction_token_ids:
                occurrences = state.occurrences  # the prediction did not change: keep its index
            state = _PredictionState(request.prediction_token_ids, occurrences=occurrences)
            self._states[request.request_id] = state
        prediction_ids = state.prediction_token_ids
        num_predicted = len(prediction_ids)
        for i in range(state.num_processed, len(output_ids)):
            if (
                state.is_synced
                and state.pointer < num_predicted
                and prediction_ids[state.pointer] == output_ids[i]
            ):
                state.pointer += 1
            else:
                self._resync(state, output_ids, i + 1)
        if len(output_ids) > state.num_processed:
            state.num_processed = len(output_ids)
            state.last_token_id = output_ids[-1]
        return state

    def _resync(self, state: _PredictionState, output_ids: list[int], num_output: int) -> None:
        """Find output_ids[:num_output]'s suffix in the prediction; move the pointer after it."""
        state.is_synced = False
        min_n = self.min_match_len
        if num_output < min_n:
            return
        if state.occurrences is None:
            state.occurrences = _build_occurrences(state.prediction_token_ids, min_n)
        ends = state.occurrences.get(tuple(output_ids[num_output - min_n : num_output]))
        if not ends:
            return
        max_n = min(self.max_match_len, num_output)
        prediction_ids = state.prediction_token_ids
        first_after = bisect_left(ends, state.pointer)
        # Preference order: ends at/after the pointer ascending, then the ones before descending.
        ordered = ends[first_after : first_after + _MAX_RESYNC_CANDIDATES]
        if len(ordered) < _MAX_RESYNC_CANDIDATES:
            num_before = _MAX_RESYNC_CANDIDATES - len(ordered)
            ordered = ordered + ends[max(0, first_after - num_before) : first_after][::-1]
        best_end, best_len = -1, 0
        for end in ordered:
            match_len = min_n
            limit = min(max_n, end)
            while (
                match_len < limit
                and prediction_ids[end - 1 - match_len] == output_ids[num_output - 1 - match_len]
            ):
                match_len += 1
            if match_len > best_len:
                best_end, best_len = end, match_len
                if match_len == max_n:
                    break
        state.pointer, state.is_synced = best_end, True


def _build_occurrences(token_ids: tuple[int, ...], n: int) -> dict[tuple[int, ...], list[int]]:
    """n-gram -> ascending positions right after each occurrence of it in token_ids."""
    occurrences: dict[tuple[int, ...], list[int]] = {}
    columns = [token_ids[j : len(token_ids) - n + j + 1] for j in range(n)]
    for end, key in enumerate(zip(*columns, strict=True), start=n):
        occurrences.setdefault(key, []).append(end)
    return occurrences
