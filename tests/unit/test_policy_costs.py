"""What the speculation policy learns a draft costs from the steps it observes: a lookup judged by
its acceptance estimate and a draft model by its upper bound, the correction that prices
speculating steps by the error of their prediction (never a discount, from decode-shaped steps
only, a catch-up priced as a share predicted in full), and a draft model too far behind to repay
its catch-up skipped for that."""

from __future__ import annotations

import pytest

from engine.core.request import Request
from engine.core.schedule import Candidate, StepShape
from engine.core.stats import StepStats, VerifyResult
from engine.policy.acceptance import expected_tokens
from engine.policy.policy import SpeculationPolicy
from engine.sampling_params import SamplingParams
from tests.policy_fakes import KNEE, FixedAlphas, FlatThenLinear


def test_lookups_are_judged_by_their_estimate_and_a_draft_model_by_its_upper_bound() -> None:
    """Speculating costs 1.3 steps beyond the free drafts below the knee: four drafts pay for a
    decoding request accepting 0.65 a token, not 0.52. Evidence at 0.52 from ten one-token
    trials (as a paused lookup's shadows give) leaves its upper bound near 0.67: a lookup, which
    keeps learning while paused, stays off; a draft model, which learns only by drafting, is
    tried. Thirty-one trials more at the same rate narrow its bound below 0.6: it stops too."""
    policy = SpeculationPolicy("auto", 4, FlatThenLinear())
    for _ in range(30):
        policy.observe(StepStats((), (VerifyResult("x", "ngram", 1, 1),), 1, 1, 0, 1.0, 0.0, 1.3))
    assert policy.costs.overhead == pytest.approx(1.3, rel=0.01)
    lookup, model = (
        Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=64), 64) for i in range(2)
    )

    def trials(num: int) -> None:
        for i in range(num):
            for request, source in ((lookup, "ngram"), (model, "draft_model")):
                result = VerifyResult(request.request_id, source, 1, i % 2, is_shadow=True)
                policy.observe(StepStats((), (result,), 1, 1, 0, 1.0, 0.0, 0.0))

    trials(10)
    assert policy.tracker.alpha("r0/ngram", "ngram") == pytest.approx(0.52, abs=0.01)
    assert policy.tracker.upper_bound("r0/ngram", "ngram") == pytest.approx(0.67, abs=0.01)
    assert expected_tokens(0.52, 4) < 2.3 < expected_tokens(0.65, 4)
    step = StepShape(1, 1, 0, 256, 1)
    assert policy.decide([Candidate(lookup, 4, "ngram")], step)[0].num_draft_tokens == 0
    assert policy.decide([Candidate(model, 4, "draft_model")], step)[0].num_draft_tokens == 4
    trials(31)
    assert policy.tracker.upper_bound("r1/draft_model", "draft_model") < 0.6
    assert policy.decide([Candidate(model, 4, "draft_model")], step)[0].num_draft_tokens == 0


def test_speculating_steps_that_cost_more_than_predicted_are_priced_by_that_error() -> None:
    """With a step-time model that cannot learn (a fake), speculating steps that take twice
    their prediction teach a correction of 2, which prices out drafts that paid on the model alone,
    and the correction fades once no speculating step confirms it."""
    policy = SpeculationPolicy("auto", 7, FlatThenLinear())
    policy.tracker = FixedAlphas()  # type: ignore[assignment]
    batch = [Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=64), 64) for i in range(4)]
    policy.tracker.alphas.update({r.request_id: 0.5 for r in batch})
    candidates = [Candidate(r, 7, "ngram") for r in batch]
    step = StepShape(4, 4, 0, 256, 4)
    assert sum(d.num_draft_tokens for d in policy.decide(candidates, step)) == 4  # to the knee
    plain = StepStats((), (), 4, 4, 0, 1.0, 0.0, 0.0)  # as predicted
    drafted = StepStats((), (VerifyResult("r0", "ngram", 4, 2),), 8, 8, 0, 2.0, 0.0, 0.0)
    for _ in range(40):
        policy.observe(plain)
        policy.observe(drafted)
    assert policy.costs.correction == pytest.approx(2.0, rel=0.1)
    decisions = policy.decide(candidates, step)
    assert [d.num_draft_tokens for d in decisions] == [0] * 4
    assert {d.reason for d in decisions} == {"compute_bound"}
    for _ in range(400):
        policy.observe(plain)
    assert policy.costs.correction == pytest.approx(1.0, abs=0.05)
    assert sum(d.num_draft_tokens for d in policy.decide(candidates, step)) == 4


def test_the_correction_is_never_a_discount() -> None:
    """Plain steps slowed by the host (1.1x their prediction) beside verify steps as predicted
    give a quotient of about 0.91. Taken as a discount it would buy drafts on a compute-bound
    batch, where each draft row costs a full token's share of the step and a draft accepted 90%
    of the time earns less than it costs (the step trace showed exactly that: drafting wherever
    the quotient dipped below 1); the correction stays 1 and the batch decodes."""
    policy = SpeculationPolicy("auto", 7, FlatThenLinear())
    policy.tracker = FixedAlphas()  # type: ignore[assignment]
    batch = [Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=64), 64) for i in range(16)]
    policy.tracker.alphas.update({r.request_id: 0.9 for r in batch})
    candidates = [Candidate(r, 7, "ngram") for r in batch]
    step = StepShape(2 * KNEE, 2 * KNEE, 0, 256, 2 * KNEE)  # past the knee: compute-bound
    slowed = StepStats((), (), 2 * KNEE, 2 * KNEE, 0, 2.2, 0.0, 0.0)  # predicted 2.0
    verify = StepStats(
        (), (VerifyResult("r0", "ngram", 1, 1),), 2 * KNEE + 1, 2 * KNEE + 1, 0, 2.125, 0.0, 0.0
    )  # as predicted
    for _ in range(40):
        policy.observe(slowed)
        policy.observe(verify)
    quotient = policy.costs._error[True] / policy.costs._error[False]
    assert quotient == pytest.approx(1.0 / 1.1, rel=0.03)
    assert policy.costs.correction == 1.0
    decisions = policy.decide(candidates, step)
    assert [d.num_draft_tokens for d in decisions] == [0] * 16
    assert {d.reason for d in decisions} == {"compute_bound"}


def test_the_correction_compares_decode_shaped_steps_only() -> None:
    """Plain steps that carry a prompt chunk and run twice their prediction must not turn the
    correction into a discount: it compares verify steps (1.2x their prediction) with the
    decode steps they replace (as predicted), and steps with a prompt chunk teach neither side."""
    policy = SpeculationPolicy("auto", 7, FlatThenLinear())
    decode = StepStats((), (), 4, 4, 0, 1.0, 0.0, 0.0)  # as predicted
    chunk = StepStats((), (), 8 * KNEE, 4, 0, 16.0, 0.0, 0.0)  # twice its prediction
    verify = StepStats((), (VerifyResult("r0", "ngram", 4, 2),), 8, 8, 0, 1.2, 0.0, 0.0)
    chunk_and_drafts = StepStats(
        (), (VerifyResult("r0", "ngram", 4, 2),), 8 * KNEE + 4, 8, 0, 40.0, 0.0, 0.0
    )
    for _ in range(60):
        for stats in (decode, chunk, chunk, verify, chunk_and_drafts):
            policy.observe(stats)
    assert policy.costs.correction == pytest.approx(1.2, rel=0.05)


def test_a_catch_up_priced_as_a_share_is_predicted_in_full_for_the_correction() -> None:
    """A draft model's catch-up is charged to a decision as the share of it the step's tokens
    buy, but the step takes all of it: a step that costs exactly the forwards plus the whole
    catch-up was predicted right, and must not teach a correction that prices drafting out."""
    policy = SpeculationPolicy(
        "auto", 4, FlatThenLinear(), draft_forward_seconds=0.1, catch_up_seconds_per_token=0.01
    )
    policy.tracker = FixedAlphas({"r0": 0.9})  # type: ignore[assignment]
    request = Request("r0", [1, 2, 3], SamplingParams(max_tokens=64), 64)
    # 40 tokens: within a step's chunk (half the 1 s step at 0.01 s a token), so it drafts now.
    candidates = [Candidate(request, 4, "draft_model", num_catch_up=40)]
    decisions = policy.decide(candidates, StepShape(1, 1, 0, 256, 1))
    assert [d.num_draft_tokens for d in decisions] == [4]
    forwards = 0.1 * expected_tokens(0.9, 3)
    stats = StepStats(
        tuple(decisions),
        (VerifyResult("r0", "draft_model", 4, 3),),
        5,
        5,
        0,
        1.0,  # the target forward, as the step-time model predicts it
        forwards + 0.01 * 40,  # the draft model's forwards and its whole catch-up
        0.0,
    )
    policy.observe(stats)
    assert policy.costs.correction == pytest.approx(1.0, abs=1e-6)


def test_a_draft_model_too_far_behind_to_repay_its_catch_up_is_skipped_for_that() -> None:
    """At batch 1 a draft model accepting 0.9 pays when current; 5,000 tokens behind with 60
    tokens left to generate, the catch-up its drafts would have to repay does not: the skip says
    catch_up_cost, not compute_bound (nothing in the batch stopped it) nor low_acceptance. A
    draft model that would not pay even when current is low_acceptance, behind or not."""
    policy = SpeculationPolicy(
        "auto", 4, FlatThenLinear(), draft_forward_seconds=0.1, catch_up_seconds_per_token=0.01
    )
    policy.tracker = FixedAlphas({"near": 0.9, "far": 0.9, "weak": 0.02})  # type: ignore[assignment]
    step = StepShape(1, 1, 0, 256, 1)

    def decide(name: str, num_catch_up: int) -> tuple[int, str]:
        request = Request(name, [1, 2, 3], SamplingParams(max_tokens=64), 64)
        request.output_token_ids.extend([5, 6, 7, 8])
        candidate = Candidate(request, 4, "draft_model", num_catch_up=num_catch_up)
        (decision,) = policy.decide([candidate], step)
        return decision.num_draft_tokens, decision.reason

    assert decide("near", 0)[0] > 0
    assert decide("far", 5000) == (0, "catch_up_cost")
    assert decide("weak", 0) == (0, "low_acceptance")
    assert decide("weak", 5000) == (0, "low_acceptance")
