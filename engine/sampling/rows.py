"""A request's sampling rows: its options and token history at one output position (the drafts so
far included, without copying the output), keyed for that position's randomness and stream.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from engine.core.request import Request
from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class SamplingRow:
    """One row of logits to sample: the request's params and its token history."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # tokens generated BEFORE this row's token
    # Key of the row's randomness (`Request.random_key`); None: a fresh random key when sampled.
    random_key: int | None


# Randomness streams of one output position (stream 0 samples the token itself).
VERIFY_STREAM = 1


DRAFT_STREAM = 2


class _History(Sequence[int]):
    """A request's output followed by the first drafts, without copying the output."""

    def __init__(self, base: Sequence[int], extra: Sequence[int]) -> None:
        self._base, self._extra = base, extra

    def __len__(self) -> int:
        return len(self._base) + len(self._extra)

    def __getitem__(self, i):  # type: ignore[no-untyped-def, override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        n = len(self._base)
        return self._base[i] if i < n else self._extra[i - n]

    def __iter__(self) -> Iterator[int]:
        yield from self._base
        yield from self._extra


class _Unread(Sequence[int]):
    """The history of a row whose last token is in flight: its length only."""

    def __init__(self, length: int) -> None:
        self._length = length

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, i):  # type: ignore[no-untyped-def, override]
        raise LookupError("the history of a row in flight has no values on the host")


def sampling_row(
    request: Request, draft_ids: Sequence[int], device: torch.device, stream: int = 0
) -> SamplingRow:
    """The row for the position after request's output followed by draft_ids, keyed for that
    position and stream. (`device`, where the logits live, is kept for callers: the key is a
    plain integer, its draws are made on the logits' device.)"""
    params, output = request.params, request.output_token_ids
    index = len(output) + request.num_in_flight + len(draft_ids)
    history: Sequence[int] = _History(output, draft_ids) if draft_ids else output
    if request.num_in_flight:
        # Its last token is still on the device (an overlapped step): only rows that read no
        # history's values get here (no penalties), and what they read, its length, is fixed.
        assert not draft_ids and not params.has_penalties
        history = _Unread(index)
    return SamplingRow(
        params=params,
        prompt_token_ids=request.prompt_token_ids,
        output_token_ids=history,
        random_key=None if params.is_greedy else request.random_key(index, stream),
    )


def sampling_rows(
    request: Request, draft_ids: Sequence[int], device: torch.device
) -> list[SamplingRow]:
    """The len(draft_ids) + 1 rows of a request verifying draft_ids (one row without drafts)."""
    return [sampling_row(request, draft_ids[:j], device) for j in range(len(draft_ids) + 1)]
