"""What the scheduler decides for a step (`SchedulerOutput`: each request's tokens and draft
tokens) and what it asks the policy about its decoding requests (`Candidate`s in a `StepShape`).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.core.drafts import DraftOffer
from engine.core.request import Request
from engine.core.stats import Decision


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step: known tokens to compute, and draft tokens it may verify
    (slots are reserved for both; a proposer may fill fewer drafts than granted) from its offer."""

    request: Request
    num_new_tokens: int
    num_draft_tokens: int = 0
    offer: DraftOffer | None = None


@dataclass(frozen=True)
class SchedulerOutput:
    """What to compute this step, in batch order, and the policy's final decisions."""

    scheduled: tuple[ScheduledRequest, ...]
    decisions: tuple[Decision, ...] = ()
    num_preempted: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens + s.num_draft_tokens for s in self.scheduled)


@dataclass(frozen=True)
class Candidate:
    """A decoding request the policy decides for: the most drafts the step has room for (and its
    source can fill), the source that would draft, and the tokens a draft model would first have
    to catch up on."""

    request: Request
    room: int
    source: str
    num_catch_up: int = 0

    @property
    def key(self) -> str:  # one acceptance estimate per request and source
        return acceptance_key(self.request.request_id, self.source)


def acceptance_key(request_id: str, source: str) -> str:
    return f"{request_id}/{source}"


@dataclass(frozen=True)
class StepShape:
    """The step the drafts would join: its query tokens and logits rows without drafts, its
    attention's KV reads without drafts, the token budget left for drafts, the running batch size
    and the KV reads of one draft token (the mean length of the decoding sequences)."""

    base_tokens: int
    base_rows: int
    context: int
    budget: int
    num_running: int
    reads_per_draft: float = 0.0

    def context_with(self, num_drafts: int) -> int:
        """The step's KV reads with num_drafts draft tokens on top."""
        return self.context + round(num_drafts * self.reads_per_draft)
