"""The `Proposer` protocol every draft source implements, and the base of the lookup drafters.

A proposer is asked, once per step, for drafts for the decoding requests the scheduler granted
draft tokens to; it may propose fewer tokens than granted, or none. Drafts without a
distribution (n-gram lookup, predicted outputs, a greedy draft model) are verified as one-hot q.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from engine.core.drafts import Draft
from engine.core.request import Request


class Proposer(Protocol):
    """A source of draft tokens."""

    name: str

    def prepare(self, scheduled: Sequence[tuple[Request, int]]) -> None:
        """Called once per step before `propose`, with every scheduled request and the number of
        tokens the target computes for it this step (a model drafter keeps its KV in sync with
        the target's prefill chunks from this; lookup drafters need nothing)."""
        ...

    def propose(
        self, requests: Sequence[Request], max_lengths: Sequence[int]
    ) -> list[Draft | None]:
        """One entry per request: up to max_lengths[i] draft tokens that would follow
        request.all_token_ids, or None when this source has nothing to offer."""
        ...

    def free(self, request: Request) -> None:
        """Forget per-request state (the request finished, was aborted or preempted)."""
        ...


class LookupProposer:
    """Base of proposers that draft one request at a time from per-request state, catch up
    lazily when asked, and keep no KV (n-gram lookup, predicted outputs)."""

    name: str

    def __init__(self) -> None:
        self._states: dict[str, Any] = {}

    @property
    def num_tracked_requests(self) -> int:
        return len(self._states)

    def prepare(self, scheduled: Sequence[tuple[Request, int]]) -> None:
        """Nothing to do: the state catches up lazily in propose."""

    def propose(
        self, requests: Sequence[Request], max_lengths: Sequence[int]
    ) -> list[Draft | None]:
        return [self._propose_one(r, k) for r, k in zip(requests, max_lengths, strict=True)]

    def free(self, request: Request) -> None:
        self._states.pop(request.request_id, None)

    def _propose_one(self, request: Request, max_length: int) -> Draft | None:
        raise NotImplementedError
