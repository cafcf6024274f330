"""The speculation policy's core: expected tokens, draft allocation against a fake step-time model
(flat to 8 query tokens, then proportional to n: compute-bound), reasons, hysteresis, the fitted
step-time model, and the acceptance estimate on seeded synthetic verifies."""

from __future__ import annotations

import collections
import itertools
import json
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest

from engine.core.request import Request
from engine.core.schedule import Candidate, StepShape
from engine.core.stats import StepStats, VerifyResult
from engine.policy.acceptance import (
    ACCEPTANCE_DECAY,
    PRIOR_WEIGHT,
    AcceptanceTracker,
    expected_tokens,
)
from engine.policy.goodput import AffineDraftCost, best_draft_lengths, forward_seconds, goodput
from engine.policy.policy import SpeculationPolicy
from engine.policy.step_time import StepTimeModel
from engine.sampling_params import SamplingParams
from tests.policy_fakes import KNEE, Driver, FixedAlphas, FixedMonitor, FlatThenLinear


@dataclass(frozen=True)
class MeasuredCpu:
    """The issue's CPU curve: flat to 8 tokens, 16 tokens +30%, 64 tokens 2x (interpolated)."""

    def predict(self, n: int, context: int = 0, rows: int = 1) -> float:
        points = [(1, 1.0), (8, 1.0), (16, 1.3), (64, 2.0)]
        for (n0, t0), (n1, t1) in itertools.pairwise(points):
            if n <= n1:
                return t0 + (t1 - t0) * max(n - n0, 0) / (n1 - n0)
        return 2.0 + (0.7 / 48) * (n - 64)


@dataclass(frozen=True)
class Decided:
    num_draft_tokens: tuple[int, ...]
    reasons: tuple[str, ...]
    goodput: float


def _per_token(cost: float | Callable[[int], float]) -> Callable[[int], float]:
    return cost if callable(cost) else (lambda num_draft_tokens: cost * num_draft_tokens)


def _shape(base: int, budget: int | None = None) -> StepShape:
    return StepShape(base, base, 0, 10**9 if budget is None else budget, base)


def _allocate(alphas, caps, base, model, cost=0.0, budget=None) -> tuple[list[int], float]:
    """The allocator alone: drafts cost `cost` seconds per token (or cost(total))."""
    ks = best_draft_lengths(alphas, caps, _shape(base, budget), model, _per_token(cost))
    return ks, goodput(alphas, ks, _shape(base, budget), model, _per_token(cost))


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


def test_expected_tokens_is_the_geometric_sum() -> None:
    assert expected_tokens(0.8, 3) == pytest.approx(1 + 0.8 + 0.64 + 0.512)
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 0) == 1.0
    for alpha, k in itertools.product([0.1, 0.5, 0.9, 0.999], range(8)):
        assert expected_tokens(alpha, k) == pytest.approx(sum(alpha**j for j in range(k + 1)))
    with pytest.raises(ValueError):
        expected_tokens(1.2, 3)


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


def test_higher_acceptance_gets_more_drafts() -> None:
    (k_high, k_low), _ = _allocate([0.95, 0.5], [7, 7], 2, FlatThenLinear())
    assert k_high + k_low == KNEE - 2 and k_high > k_low


@pytest.mark.parametrize("seed", range(6))
def test_greedy_matches_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    alphas = [rng.uniform(0.05, 0.98) for _ in range(3)]
    caps = [rng.randint(0, 5) for _ in range(3)]
    base = rng.randint(1, 14)
    model = rng.choice([FlatThenLinear(), MeasuredCpu()])
    cost = rng.choice([0.0, 0.01, 0.05])
    _, value = _allocate(alphas, caps, base, model, cost)
    best = max(
        goodput(alphas, ks, _shape(base), model, _per_token(cost))
        for ks in itertools.product(*(range(c + 1) for c in caps))
    )
    assert value == pytest.approx(best, rel=1e-12)


def test_allocation_walks_past_a_step_in_the_curve() -> None:
    # Padded shapes make step time a staircase: 9..32 tokens cost one price. Stopping at the
    # first draft that lowers goodput (the 8th) would miss the plateau after it.
    class Staircase:
        def predict(self, n: int, context: int = 0, rows: int = 1) -> float:
            return 1.0 if n <= 8 else 1.15 if n <= 32 else 1.15 * n / 32

    ks, value = _allocate([0.95], [31], 1, Staircase())
    assert ks == [31]
    assert value == pytest.approx(expected_tokens(0.95, 31) / 1.15)


@pytest.mark.parametrize("seed", range(20))
def test_allocations_on_one_shape_share_its_forwards(seed: int) -> None:
    """The policy allocates once per draft-model depth on one step shape: with a shared
    `forwards`, each draft count's forward is predicted once over all of them, and every
    allocation is the one it makes on its own."""
    rng = random.Random(seed)
    n = rng.randint(1, 40)
    alphas = [rng.uniform(0.05, 0.98) for _ in range(n)]
    shape = StepShape(n, n, rng.randint(0, 5000), rng.choice([8, 64, 10**9]), n, 300.0)
    calls: collections.Counter[tuple[int, int, int]] = collections.Counter()

    class Counting(MeasuredCpu):
        def predict(self, n: int, context: int = 0, rows: int = 1) -> float:
            calls[(n, context, rows)] += 1
            return super().predict(n, context, rows)

    model, plain = Counting(), MeasuredCpu()
    forwards: dict[int, float] = {}
    for depth in range(6):
        caps = [rng.randint(0, depth + 1) for _ in range(n)]
        cost = AffineDraftCost(
            rng.uniform(0.0, 0.2), 0.1, 0.0, lambda m: forward_seconds(shape, model, m)
        )
        shared = best_draft_lengths(alphas, caps, shape, model, cost, forwards)
        assert shared == best_draft_lengths(alphas, caps, shape, plain, cost)
    assert calls and max(calls.values()) == 1
    assert sorted(forwards) == list(range(len(forwards)))


@pytest.mark.parametrize("seed", range(40))
def test_an_affine_draft_cost_allocates_as_its_callable_does(seed: int) -> None:
    """The allocator prices an AffineDraftCost from its coefficients (one prediction a draft
    count, the cost not called); the drafts and the goodput equal those of the same cost as a
    plain callable, over random batches, costs and curves, with a fixed cost on top or not."""
    rng = random.Random(seed)
    n = rng.randint(1, 40)
    alphas = [rng.uniform(0.05, 0.98) for _ in range(n)]
    caps = [rng.randint(0, 6) for _ in range(n)]
    model = rng.choice([FlatThenLinear(), MeasuredCpu(), FlatThenLinear(row_cost=0.3)])
    shape = StepShape(
        n, n, rng.randint(0, 5000), rng.choice([8, 64, 10**9]), n, rng.uniform(0, 900)
    )
    with_drafts, per_forward = rng.uniform(0.0, 0.2), rng.choice([0.0, rng.uniform(0.0, 0.5)])
    fixed = rng.choice([0.0, rng.uniform(0.0, 0.3)])
    affine = AffineDraftCost(
        with_drafts, per_forward, 0.0, lambda m: forward_seconds(shape, model, m)
    ).plus(fixed)

    def plain(m: int) -> float:
        forward = forward_seconds(shape, model, m)
        return (with_drafts + per_forward * forward if m else 0.0) + fixed

    ks = best_draft_lengths(alphas, caps, shape, model, affine)
    assert ks == best_draft_lengths(alphas, caps, shape, model, plain)
    assert all(0 <= k <= c for k, c in zip(ks, caps, strict=True)) and sum(ks) <= shape.budget
    for m in (0, 1, 7):
        assert affine(m) == pytest.approx(plain(m), rel=1e-12)
    assert goodput(alphas, ks, shape, model, affine) == pytest.approx(
        goodput(alphas, ks, shape, model, plain), rel=1e-12
    )


def test_callable_draft_cost_sees_the_total() -> None:
    seen: list[int] = []

    def cost(num_draft_tokens: int) -> float:
        seen.append(num_draft_tokens)
        return 0.5 if num_draft_tokens else 0.0  # a fixed launch cost once anything is drafted

    ks, _ = _allocate([0.3], [7], 1, FlatThenLinear(), cost)
    # 1.43 tokens for 1.5 steps loses to 1 token for 1 step.
    assert ks == [0] and max(seen) >= 1


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


def _true_step_time(n: int, context: int) -> float:
    plateau = 0.2
    tail = 0.0075 * max(0, n - 8) if n <= 16 else 0.06 + 0.003 * (n - 16)
    return plateau + tail + 2e-6 * context


def _samples(rng: random.Random, noise: float) -> list[tuple[int, int, float]]:
    return [
        (n, ctx, _true_step_time(n, ctx) * (1 + rng.gauss(0, noise)))
        for n in [1, 2, 4, 8, 16, 32, 64]
        for ctx in [0, 4096, 16384]
        for _ in range(3)
    ]


def test_fit_recovers_a_known_curve_and_stays_monotone() -> None:
    model = StepTimeModel.fit(_samples(random.Random(0), noise=0.01))
    for n, ctx in itertools.product([1, 3, 8, 12, 16, 40, 64], [0, 8192]):
        assert model.predict(n, ctx) == pytest.approx(_true_step_time(n, ctx), rel=0.03)
    assert model.context_coef == pytest.approx(2e-6, rel=0.2)
    assert model.knee == 8
    for ctx in [0, 16384]:
        times = [model.predict(n, ctx) for n in range(1, 200)]
        assert all(b >= a for a, b in itertools.pairwise(times))


def test_fit_repairs_non_monotone_measurements() -> None:
    model = StepTimeModel.fit([(1, 0, 1.0), (2, 0, 1.2), (4, 0, 1.1), (8, 0, 1.5)])
    assert model.values == pytest.approx([1.0, 1.15, 1.15, 1.5])
    assert model.context_coef == 0.0


def test_observe_follows_a_slower_device() -> None:
    model = StepTimeModel.fit(_samples(random.Random(1), noise=0.0))
    rng = random.Random(2)
    for _ in range(600):
        n, ctx = rng.choice([1, 2, 4, 8, 16, 32, 64]), 4096
        model.observe(n, ctx, 1.5 * _true_step_time(n, ctx))
    for n in [1, 8, 16, 64]:
        assert model.predict(n, 4096) == pytest.approx(1.5 * _true_step_time(n, 4096), rel=0.02)
    assert all(b >= a for a, b in itertools.pairwise(model.values))


def test_a_burst_at_one_size_does_not_ratchet_its_neighbours_up() -> None:
    """The envelope that keeps predictions non-decreasing is not learned: a burst of slow
    one-token steps lifts t(2)'s prediction while it lasts, and once one-token steps are fast
    again t(2) is back, with no two-token step observed in between (the policy, pricing them
    dear, would not take any). Learned values lifted to the envelope stayed up for good."""
    model = StepTimeModel([1, 2, 3, 4], [0.040, 0.045, 0.050, 0.055])
    for _ in range(20):
        model.observe(1, 0, 0.070)  # another process holds the machine
    assert model.predict(2) >= model.predict(1) > 0.060  # the envelope: never t(2) < t(1)
    for _ in range(60):
        model.observe(1, 0, 0.040)
    assert model.predict(1) == pytest.approx(0.040, rel=0.02)
    assert model.predict(2) == pytest.approx(0.045, rel=0.02)
    assert model.predict(3) == pytest.approx(0.050, rel=0.02)
    # A step of two tokens still teaches t(2) against its own learned value.
    for _ in range(60):
        model.observe(2, 0, 0.048)
    assert model.predict(2) == pytest.approx(0.048, rel=0.02)


def test_to_dict_round_trip() -> None:
    model = StepTimeModel.fit(_samples(random.Random(3), noise=0.01))
    copy = StepTimeModel.from_dict(json.loads(json.dumps(model.to_dict())))
    for n, ctx in itertools.product(range(1, 100, 7), [0, 5000]):
        assert copy.predict(n, ctx) == model.predict(n, ctx)
    assert copy.knee == model.knee
    with pytest.raises(ValueError, match="version"):
        StepTimeModel.from_dict({**model.to_dict(), "version": 99})


def _verify(rng: random.Random, alpha: float, k: int) -> int:
    accepted = 0
    while accepted < k and rng.random() < alpha:
        accepted += 1
    return accepted


@pytest.mark.parametrize("alpha", [0.3, 0.6, 0.9])
def test_acceptance_tracker_converges_to_the_true_alpha(alpha: float) -> None:
    rng = random.Random(int(alpha * 100))
    tracker = AcceptanceTracker(decay=0.995)
    num_drafted = num_accepted = 0
    for _ in range(3000):
        k = rng.randint(1, 6)
        a = _verify(rng, alpha, k)
        tracker.observe("r", "ngram", k, a)
        num_drafted, num_accepted = num_drafted + k, num_accepted + a
    assert tracker.alpha("r", "ngram") == pytest.approx(alpha, abs=0.03)
    if alpha < 0.9:
        # accepted / drafted counts untested positions as failures: the bias the MLE avoids.
        assert alpha - num_accepted / num_drafted > 0.1


def test_acceptance_tracker_prior_decay_and_forget() -> None:
    tracker = AcceptanceTracker()
    assert tracker.alpha("new", "prediction") == tracker.priors["prediction"]
    rng = random.Random(7)
    for _ in range(200):
        tracker.observe("r", "draft_model", 5, _verify(rng, 0.9, 5))
    assert tracker.alpha("r", "draft_model") > 0.8
    for _ in range(50):
        tracker.observe("r", "draft_model", 5, _verify(rng, 0.2, 5))
    assert tracker.alpha("r", "draft_model") < 0.35
    tracker.forget("r")
    assert tracker.alpha("r", "draft_model") == tracker.priors["draft_model"]
    with pytest.raises(ValueError):
        tracker.observe("r", "ngram", 3, 4)


def test_the_upper_bound_is_wide_without_history_and_narrows_with_it() -> None:
    tracker = AcceptanceTracker()
    prior = tracker.priors["draft_model"]
    fresh = tracker.upper_bound("new", "draft_model")
    assert fresh > prior + 0.2  # one standard error of two pseudo-trials at 0.6: ~0.35
    rng = random.Random(3)
    widths = []
    for _ in range(40):
        tracker.observe("r", "draft_model", 5, _verify(rng, 0.3, 5))
        widths.append(tracker.upper_bound("r", "draft_model") - tracker.alpha("r", "draft_model"))
    assert widths[-1] < widths[0] and widths[-1] < 0.15
    assert tracker.upper_bound("r", "draft_model") < prior  # evidence overrides the optimism
    assert AcceptanceTracker(optimism=0.0).upper_bound("new", "ngram") == tracker.priors["ngram"]
    with pytest.raises(ValueError):
        AcceptanceTracker(optimism=-1.0)


def test_the_upper_bound_keeps_narrowing_past_the_decays_horizon() -> None:
    """alpha reads decayed sums (about ten verifies' worth), but the bound's width counts every
    trial: a request drafting one token a step, 58% of them kept, is judged near 0.58 once it
    has a hundred verifies behind it, not at the 0.72 a width from the decayed sums holds it at;
    and alpha still follows a change."""
    tracker = AcceptanceTracker()
    rng = random.Random(5)
    widths = []
    for _ in range(200):
        tracker.observe("r", "draft_model", 1, int(rng.random() < 0.58))
        widths.append(tracker.upper_bound("r", "draft_model") - tracker.alpha("r", "draft_model"))
    alpha = tracker.alpha("r", "draft_model")
    decayed = math.sqrt(alpha * (1 - alpha) / (1 / (1 - ACCEPTANCE_DECAY) + PRIOR_WEIGHT))
    assert widths[20] < 0.8 * decayed and widths[-1] < 0.4 * decayed and widths[-1] < 0.05
    assert max(widths[100:]) < min(widths[:20])
    for _ in range(20):  # the text turns predictable: alpha follows within a few verifies
        tracker.observe("r", "draft_model", 1, 1)
    assert tracker.alpha("r", "draft_model") > 0.85


def test_a_model_drafters_new_request_starts_from_its_recent_requests() -> None:
    """A pooled method's new request starts near what the method kept on the requests before it
    (not the fixed 0.6 and its wide bound); its own verifies take over within a few (a request
    that always fails ends where the fixed prior would leave it, whatever its peers kept); a
    lookup does not pool; with no drafting for a few hundred steps the fixed prior is back."""
    tracker = AcceptanceTracker(pooled=frozenset({"eagle3"}))
    alone = AcceptanceTracker()
    fixed = alone.upper_bound("new", "eagle3")
    assert tracker.upper_bound("new", "eagle3") == fixed  # an empty pool: the fixed prior
    rng = random.Random(11)
    for i in range(60):  # earlier requests, three verifies each, a sixth of the tokens kept
        for _ in range(3):
            tracker.observe(f"old{i}", "eagle3", 5, _verify(rng, 0.17, 5))
            tracker.observe(f"old{i}", "ngram", 5, _verify(rng, 0.17, 5))
            tracker.tick()
        tracker.forget(f"old{i}")
    assert tracker.alpha("new", "eagle3") == pytest.approx(0.17, abs=0.07)
    assert tracker.upper_bound("new", "eagle3") < 0.4 < fixed - 0.5  # eight trials of evidence
    assert tracker.alpha("new", "ngram") == tracker.priors["ngram"]  # lookups do not pool
    # Its own verifies move it: a good request rises above the pool within a few ...
    for _ in range(4):
        tracker.observe("good", "eagle3", 5, 5)
    assert tracker.alpha("good", "eagle3") > 0.75
    # ... and one that always fails is judged as the fixed prior would judge it.
    for _ in range(20):
        for t in (tracker, alone):
            t.observe("bad", "eagle3", 5, 0)
    assert tracker.upper_bound("bad", "eagle3") == pytest.approx(
        alone.upper_bound("bad", "eagle3"), abs=1e-4
    )
    for _ in range(1000):  # idle: nobody drafts with the head
        tracker.tick()
    assert tracker.upper_bound("another", "eagle3") == fixed


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


def test_verify_steps_refine_the_step_time_model_at_their_own_shape() -> None:
    """Calibration times one sequence's chunk; a verify step of 4 decoding sequences and 8
    drafts is a batch of 12 decode-shaped rows that costs more. Plain steps never reach n = 12,
    so only the verify steps' own timings can teach the model what a draft row costs there."""
    model = StepTimeModel([1, 4, 8, 16], [1.0, 1.0, 1.2, 1.6])
    policy = SpeculationPolicy("auto", 7, model)
    plain = StepStats((), (), 4, 4, 0, 1.0, 0.0, 0.0)  # as calibrated
    verify = StepStats((), (VerifyResult("r0", "ngram", 8, 4),), 12, 12, 0, 1.8, 0.0, 0.0)
    assert model.predict(12, 0, 12) == pytest.approx(1.4)
    for _ in range(60):
        policy.observe(plain)
        policy.observe(verify)
    assert model.predict(12, 0, 12) == pytest.approx(1.8, rel=0.02)
    assert model.predict(4, 0, 4) == pytest.approx(1.0, rel=0.02)  # the plain shape kept
    # The model now predicts the verify steps right, so their error no longer needs correcting.
    assert policy.costs.correction == pytest.approx(1.0, abs=0.05)
