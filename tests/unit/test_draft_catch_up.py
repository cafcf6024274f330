"""A draft model's catch-up is bounded per step: a request the draft model is far behind on (its
whole prompt the first time, what n-gram drafted while it was idle) is caught up in chunks, each
a share of the step's predicted forward, and drafts once current; catching up is taken only when
the drafts it buys pay for it. Scripted step times (tests/policy_fakes.py) and fixed acceptance
estimates: nothing here reads a clock."""

from __future__ import annotations

import pytest

from engine.core.drafts import MAX_CATCH_UP_CHUNK
from engine.core.request import Request
from engine.core.schedule import Candidate, StepShape
from engine.core.stats import StepStats, VerifyResult
from engine.policy.costs import CATCH_UP_SHARE, MIN_CATCH_UP_CHUNK, DraftCosts
from engine.policy.policy import SpeculationPolicy
from engine.sampling_params import SamplingParams
from tests.policy_fakes import FixedAlphas, FlatThenLinear

PER_TOKEN = 0.01  # seconds of draft-model catch-up per token
STEP = 1.0  # the fake's seconds for a decode step
CHUNK = int(CATCH_UP_SHARE * STEP / PER_TOKEN)  # 50 tokens a step


def _policy(mode: str = "auto", per_token: float = PER_TOKEN) -> SpeculationPolicy:
    policy = SpeculationPolicy(
        mode, 4, FlatThenLinear(), draft_forward_seconds=0.01, catch_up_seconds_per_token=per_token
    )
    policy.tracker = FixedAlphas({"r0": 0.9, "r1": 0.9, "r2": 0.9})  # type: ignore[assignment]
    return policy


def _request(name: str = "r0", max_tokens: int = 256) -> Request:
    return Request(name, [1, 2, 3], SamplingParams(max_tokens=max_tokens), max_tokens)


def _one(policy: SpeculationPolicy, candidates: list[Candidate]):
    return policy.decide(candidates, StepShape(len(candidates), len(candidates), 0, 256, 3))


def test_the_chunk_is_a_share_of_the_step_within_bounds() -> None:
    costs = DraftCosts(0.01, PER_TOKEN)
    assert costs.catch_up_chunk(STEP) == CHUNK
    assert costs.catch_up_chunk(0.0) == MIN_CATCH_UP_CHUNK  # progress even on a tiny step
    assert costs.catch_up_chunk(1000.0) == MAX_CATCH_UP_CHUNK
    assert DraftCosts(0.01, 0.0).catch_up_chunk(STEP) == MAX_CATCH_UP_CHUNK  # cost unknown yet


def test_a_long_catch_up_is_spread_over_steps_then_the_request_drafts() -> None:
    """200 tokens behind at 50 a step: three steps of catch-up (k = 0, reason catch_up, 50 tokens
    each), then the last 50 in the drafting step's own first forward."""
    policy = _policy()
    behind, seen = 200, []
    while True:
        (d,) = _one(policy, [Candidate(_request(), 4, "draft_model", num_catch_up=behind)])
        seen.append((d.num_draft_tokens, d.reason, d.num_catch_up))
        if d.num_draft_tokens:
            break
        behind -= d.num_catch_up
        policy.observe(StepStats((d,), (), 1, 1, 0, STEP, PER_TOKEN * d.num_catch_up, 0.0))
    assert seen == [(0, "catch_up", CHUNK)] * 3 + [(4, "goodput", CHUNK)]


def test_catching_up_is_not_started_when_the_drafts_would_not_pay_for_it() -> None:
    """Five tokens left to generate cannot repay reading 2,000: no catch-up, no drafts."""
    policy = _policy()
    (d,) = _one(policy, [Candidate(_request(max_tokens=6), 4, "draft_model", num_catch_up=2000)])
    assert (d.num_draft_tokens, d.num_catch_up) == (0, 0)
    assert d.reason != "catch_up"
    # The same request with a long reply ahead is worth catching up on.
    (d,) = _one(policy, [Candidate(_request(), 4, "draft_model", num_catch_up=2000)])
    assert (d.reason, d.num_catch_up) == ("catch_up", CHUNK)


def test_requests_catching_up_share_one_chunk_with_the_drafting_ones() -> None:
    """The step's catch-up, over every request, stays within its chunk: a drafting request's own
    10 tokens come first, then the far-behind ones in order; one left without tokens waits."""
    policy = _policy()
    candidates = [
        Candidate(_request("r0"), 4, "draft_model", num_catch_up=10),
        Candidate(_request("r1"), 4, "draft_model", num_catch_up=300),
        Candidate(_request("r2"), 4, "draft_model", num_catch_up=300),
    ]
    decisions = _one(policy, candidates)
    assert [(d.reason, d.num_catch_up) for d in decisions] == [
        ("goodput", 10),
        ("catch_up", CHUNK - 10),
        ("catch_up", 0),
    ]
    assert decisions[0].num_draft_tokens > 0
    assert sum(d.num_catch_up for d in decisions) <= CHUNK


def test_mode_always_catches_up_in_chunks_too() -> None:
    policy = _policy("always")
    candidates = [
        Candidate(_request("r0"), 4, "draft_model", num_catch_up=1000),
        Candidate(_request("r1"), 4, "ngram"),
    ]
    decisions = _one(policy, candidates)
    assert [(d.num_draft_tokens, d.reason, d.num_catch_up) for d in decisions] == [
        (0, "catch_up", CHUNK),
        (4, "fixed", 0),
    ]


def test_a_catch_up_beside_drafts_is_predicted_for_the_correction() -> None:
    """A step that catches up on one request while another verifies n-gram drafts takes the
    chunk's seconds as well: predicted so, it teaches no correction that prices drafts out."""
    policy = _policy()
    candidates = [
        Candidate(_request("r0"), 2, "ngram"),
        Candidate(_request("r1"), 4, "draft_model", num_catch_up=500),
    ]
    decisions = _one(policy, candidates)
    assert [(d.num_draft_tokens > 0, d.reason) for d in decisions] == [
        (True, "goodput"),
        (False, "catch_up"),
    ]
    k = decisions[0].num_draft_tokens
    stats = StepStats(
        tuple(decisions),
        (VerifyResult("r0", "ngram", k, k),),
        2 + k,
        2 + k,
        0,
        FlatThenLinear().predict(2 + k, 0, 2 + k),  # the target forward as predicted
        PER_TOKEN * CHUNK,  # the draft model's chunk of catch-up
        0.0,
    )
    policy.observe(stats)
    assert policy.costs.correction == pytest.approx(1.0, abs=1e-6)


def test_a_catch_up_only_forward_teaches_the_per_token_cost() -> None:
    """A first forward without drafting rows is all catch-up: its seconds over its tokens."""
    from engine.core.stats import DraftTiming

    policy = _policy(per_token=0.02)
    (d,) = _one(policy, [Candidate(_request(), 4, "draft_model", num_catch_up=1000)])
    assert d.reason == "catch_up"
    timing = DraftTiming(d.num_catch_up, PER_TOKEN * d.num_catch_up, 0, 0.0, num_drafting=0)
    for _ in range(40):
        policy.observe(StepStats((d,), (), 1, 1, 0, STEP, timing.first_seconds, 0.0, timing))
    assert policy.costs.catch_up_seconds_per_token == pytest.approx(PER_TOKEN, rel=0.01)


def test_the_first_forward_is_priced_as_steps_take_it() -> None:
    """A drafting step's first forward (the draft model's reads 2 to k + 1 tokens a request) is
    learned apart from the chained ones and priced as the first of a propose's forwards: a
    first forward three times a chained one makes drafting dearer, and a k = 1 draft costs
    exactly the first forward."""
    from engine.core.stats import DraftTiming

    policy = _policy(per_token=0.0)
    costs = policy.costs
    chained = costs.draft_forward_seconds
    assert costs.first_forward_seconds is None and costs.alone(0.9, 1, True) == chained
    request = _request()
    candidates = [Candidate(request, 4, "draft_model")]
    before = costs.model_seconds(candidates, [0.8], [4], 4)
    timing = DraftTiming(2, 3 * chained, 3, 3 * chained, num_drafting=1)
    (d,) = _one(policy, candidates)
    for _ in range(60):
        policy.observe(StepStats((d,), (), 5, 5, 0, STEP, 6 * chained, 0.0, timing))
    assert costs.first_forward_seconds == pytest.approx(3 * chained, rel=1e-3)
    assert costs.draft_forward_seconds == pytest.approx(chained, rel=1e-3)
    assert costs.alone(0.9, 1, True) == pytest.approx(3 * chained, rel=1e-3)
    after = costs.model_seconds(candidates, [0.8], [4], 4)
    assert after == pytest.approx(before + 2 * chained, rel=1e-3)
