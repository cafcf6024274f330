"""The scheduler's share of speculation: it asks the policy for k from the offers it is given,
returns grants, offers and final decisions in one immutable SchedulerOutput, and a grant the KV
pool cannot hold is a skip counted as kv_cache_full, never a speculate."""

from __future__ import annotations

import dataclasses

import pytest

from engine.core.counters import PolicyStats
from engine.core.drafts import DraftOffer
from engine.core.request import Request
from engine.core.schedule import Candidate, StepShape
from engine.core.stats import Decision, StepStats
from engine.sampling_params import SamplingParams
from engine.scheduling.block_manager import BlockManager
from engine.scheduling.scheduler import Scheduler


class GrantEverything:
    """A policy that grants every candidate its room and records what it was shown."""

    def __init__(self) -> None:
        self.seen: list[tuple[list[Candidate], StepShape]] = []

    def decide(self, candidates, shape):
        self.seen.append((list(candidates), shape))
        return [Decision(c.request.request_id, c.source, c.room, "fixed") for c in candidates]


def _decoding(scheduler: Scheduler, *request_ids: str) -> list[Request]:
    """Requests of 3 prompt tokens, prefilled and given one sampled token: decoding."""
    requests = [Request(i, [1, 2, 3], SamplingParams(), 64) for i in request_ids]
    for request in requests:
        scheduler.add(request)
    out = scheduler.schedule()
    assert [s.num_new_tokens for s in out.scheduled] == [3] * len(requests)
    for request in requests:
        request.append_token(7)
        scheduler.update(request, 3)
    return requests


def test_the_policy_decides_from_the_offers_and_the_output_holds_it_all() -> None:
    policy = GrantEverything()
    scheduler = Scheduler(BlockManager(64, 4), 8, 64, 128, policy=policy)
    _decoding(scheduler, "a", "b")
    offers = {"a": DraftOffer("ngram", 3)}  # b has no source: no candidate, no decision
    out = scheduler.schedule(offers)
    ((candidates, shape),) = policy.seen
    assert [c.request.request_id for c in candidates] == ["a"]
    assert candidates[0].room == 3 and candidates[0].source == "ngram"
    assert shape.base_tokens == 2 and shape.base_rows == 2 and shape.num_running == 2
    by_id = {s.request.request_id: s for s in out.scheduled}
    assert by_id["a"].num_draft_tokens == 3 and by_id["a"].offer is offers["a"]
    assert by_id["b"].num_draft_tokens == 0 and by_id["b"].offer is None
    assert out.decisions == (Decision("a", "ngram", 3, "fixed"),)
    with pytest.raises(dataclasses.FrozenInstanceError):
        out.decisions = ()  # type: ignore[misc]


def test_a_grant_the_pool_cannot_hold_is_counted_as_kv_cache_full() -> None:
    # 2 blocks of 4 tokens: each request holds one with 4 tokens, so a draft needs a new block.
    scheduler = Scheduler(BlockManager(2, 4), 8, 64, 128, policy=GrantEverything())
    _decoding(scheduler, "a", "b")
    out = scheduler.schedule({"a": DraftOffer("ngram", 4), "b": DraftOffer("ngram", 4)})
    assert [s.num_draft_tokens for s in out.scheduled] == [0, 0]
    assert {d.reason for d in out.decisions} == {"kv_cache_full"}
    stats = PolicyStats()
    stats.observe(StepStats(out.decisions, (), 2, 2, 8, 0.0, 0.0, 0.0))
    assert stats.decisions == {("skip", "kv_cache_full"): 2}
    assert stats.num_requests_speculating == 0
    scheduler.block_manager.check_integrity()
