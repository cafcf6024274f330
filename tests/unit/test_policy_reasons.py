"""The speculation policy's decisions and the reason it gives for each, one step of decoding
requests whose acceptance is known against a fake step-time model (flat to 8 query tokens, then
proportional to n: compute-bound): speculating to the knee and falling off past it, low
acceptance told apart from compute-bound, caps, opt-outs and operator limits, the hysteresis at
break-even, and the mode switches."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import pytest

from engine.core.request import Request
from engine.core.schedule import Candidate
from engine.policy.acceptance import expected_tokens
from engine.policy.goodput import goodput
from engine.policy.policy import SpeculationPolicy
from engine.sampling_params import SamplingParams
from tests.policy_fakes import KNEE, Driver, FixedAlphas, FixedMonitor, FlatThenLinear
from tests.unit.policy_helpers import _shape


@dataclass(frozen=True)
class Decided:
    num_draft_tokens: tuple[int, ...]
    reasons: tuple[str, ...]
    goodput: float


def _decide(
    alphas: Sequence[float],
    caps: Sequence[int],
    row_cost: float = 0.0,
    cap_reasons: Sequence[str | None] | None = None,
    budget: int | None = None,
    driver: Driver | None = None,
) -> Decided:
    """The policy's decision for one step of len(alphas) decoding requests whose acceptance is
    known, each draft token costing row_cost beyond the flat-then-linear curve; a cap of 0 comes
    from its reason (an opt-out, or an operator limit)."""
    reasons = list(cap_reasons or [None] * len(alphas))
    limit = "batch_size" in reasons
    busy = "utilization" in reasons
    if driver is None:
        policy = SpeculationPolicy(
            "auto",
            64,
            FlatThenLinear(row_cost=row_cost),
            monitor=FixedMonitor(1.0) if busy else None,
            disable_batch_size=1 if limit else None,
            disable_utilization=0.5 if busy else None,
        )
        policy.tracker = FixedAlphas()  # type: ignore[assignment]
        driver = Driver(policy)
    driver.policy.tracker.alphas.update({f"r{i}": a for i, a in enumerate(alphas)})
    candidates = []
    for i, (cap, reason) in enumerate(zip(caps, reasons, strict=True)):
        params = SamplingParams(max_tokens=64, speculate=reason != "request_opt_out")
        candidates.append(Candidate(Request(f"r{i}", [1, 2, 3], params, 64), cap or 1, "ngram"))
    step = _shape(len(alphas), budget)
    ks = driver.plan(candidates, step)
    value = goodput(alphas, ks, step, driver.policy.step_model)
    return Decided(tuple(ks), tuple(driver.last_reasons), value)


def _batch(batch: int, alpha: float = 0.8, cap: int = 7, cost: float = 0.01) -> Decided:
    return _decide([alpha] * batch, [cap] * batch, cost)


def test_batch_one_speculates_to_the_knee() -> None:
    decision = _batch(1)
    # 1 + 7 drafts fill the flat region exactly; an 8th draft costs 1/8 of a step for 0.8^8.
    assert decision.num_draft_tokens == (7,)
    assert decision.reasons == ("goodput",)
    assert decision.goodput == pytest.approx(expected_tokens(0.8, 7) / (1.0 + 0.07))


def test_speculation_falls_off_past_the_knee_and_comes_back() -> None:
    totals = {}
    for batch in [1, 2, 4, 8, 16, 32, 16, 4, 1]:
        decision = _batch(batch)
        totals[batch] = sum(decision.num_draft_tokens)
        if batch >= KNEE:
            assert decision.num_draft_tokens == (0,) * batch
            assert set(decision.reasons) == {"compute_bound"}
        else:
            assert set(decision.reasons) == {"goodput"}
            # Drafts fill the free slots up to the knee and no further.
            assert batch + totals[batch] == KNEE
            assert max(decision.num_draft_tokens) - min(decision.num_draft_tokens) <= 1
    assert totals[1] == 7 and totals[16] == 0


def test_low_acceptance_is_told_apart_from_compute_bound() -> None:
    # Drafting costs 0.1 step per token; alpha 0.05 never pays, even alone on an idle engine.
    low = _decide([0.05], [5], 0.1)
    assert low.num_draft_tokens == (0,) and low.reasons == ("low_acceptance",)
    mixed = _decide([0.05, 0.9] * 8, [5] * 16, 0.1)
    assert mixed.num_draft_tokens == (0,) * 16
    assert mixed.reasons == ("low_acceptance", "compute_bound") * 8


def test_caps_opt_outs_and_operator_limits_are_honoured() -> None:
    decision = _decide([0.9, 0.9, 0.9], [2, 0, 3], 0.0, [None, "request_opt_out", None])
    assert decision.num_draft_tokens == (2, 0, 3)
    assert decision.reasons == ("goodput", "request_opt_out", "goodput")
    for reason in ["batch_size", "utilization"]:
        off = _decide([0.9] * 2, [0, 0], 0.0, [reason] * 2)
        assert off.num_draft_tokens == (0, 0) and off.reasons == (reason, reason)
    budget = _decide([0.9] * 2, [7, 7], 0.0, None, budget=3)
    assert sum(budget.num_draft_tokens) == 3


def _switches(decisions: list[int]) -> int:
    return sum((a > 0) != (b > 0) for a, b in itertools.pairwise(decisions))


def test_hysteresis_stops_flapping_at_break_even() -> None:
    # With 0.3 step per draft token, one draft pays iff alpha > 0.3: the break-even point.
    wobble = [0.31, 0.29] * 10
    plain = [_decide([a], [4], 0.3).num_draft_tokens[0] for a in wobble]
    assert _switches(plain) == len(wobble) - 1
    first = _decide([wobble[0]], [4], 0.3)
    policy = SpeculationPolicy("auto", 64, FlatThenLinear(row_cost=0.3))
    policy.tracker = FixedAlphas()  # type: ignore[assignment]
    driver = Driver(policy)
    held = [_decide([a], [4], 0.3, driver=driver).num_draft_tokens[0] for a in wobble]
    assert _switches(held) == 0 and held[0] == first.num_draft_tokens[0] == 1
    # A clear gain still switches, both ways, and an opt-out acts at once.
    assert _decide([0.05], [4], 0.3, driver=driver).reasons == ("low_acceptance",)
    assert _decide([0.7], [4], 0.3, driver=driver).num_draft_tokens[0] > 0
    opt_out = _decide([0.7], [0], 0.3, ["request_opt_out"], driver=driver)
    assert opt_out.num_draft_tokens == (0,) and opt_out.reasons == ("request_opt_out",)


def test_the_mode_switches_between_steps_and_auto_needs_a_calibrated_model() -> None:
    candidates = [
        Candidate(Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=64), 64), 4, "ngram")
        for i in range(2)
    ]
    step = _shape(2)
    policy = SpeculationPolicy("always", 4, FlatThenLinear(), is_calibrated=False)
    assert [d.num_draft_tokens for d in policy.decide(candidates, step)] == [4, 4]
    policy.set_mode("off")
    decisions = policy.decide(candidates, step)
    assert [(d.num_draft_tokens, d.reason) for d in decisions] == [(0, "mode_off")] * 2
    with pytest.raises(ValueError, match="calibrated"):
        policy.set_mode("auto")
    with pytest.raises(ValueError, match="one of off, always, auto"):
        policy.set_mode("sometimes")
    assert policy.mode == "off"  # a refused switch changes nothing
    calibrated = SpeculationPolicy("off", 4, FlatThenLinear())
    calibrated.tracker = FixedAlphas()  # type: ignore[assignment]
    calibrated.tracker.alphas.update({"r0": 0.9, "r1": 0.9})
    calibrated.set_mode("auto")
    decisions = calibrated.decide(candidates, step)
    assert [d.reason for d in decisions] == ["goodput"] * 2
    assert all(d.num_draft_tokens > 0 for d in decisions)
