"""The draft allocator (best_draft_lengths) and the goodput it maximises, against a fake step-time
model (flat to 8 query tokens, then proportional to n: compute-bound) and a measured CPU curve:
higher acceptance gets more drafts, the greedy allocation matches brute force and walks past a
step in the curve, allocations on one step shape share its forwards, and an AffineDraftCost
allocates as the same cost as a plain callable."""

from __future__ import annotations

import collections
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from engine.core.schedule import StepShape
from engine.policy.acceptance import expected_tokens
from engine.policy.goodput import AffineDraftCost, best_draft_lengths, forward_seconds, goodput
from tests.policy_fakes import KNEE, FlatThenLinear
from tests.unit.policy_helpers import _shape


@dataclass(frozen=True)
class MeasuredCpu:
    """The issue's CPU curve: flat to 8 tokens, 16 tokens +30%, 64 tokens 2x (interpolated)."""

    def predict(self, n: int, context: int = 0, rows: int = 1) -> float:
        points = [(1, 1.0), (8, 1.0), (16, 1.3), (64, 2.0)]
        for (n0, t0), (n1, t1) in itertools.pairwise(points):
            if n <= n1:
                return t0 + (t1 - t0) * max(n - n0, 0) / (n1 - n0)
        return 2.0 + (0.7 / 48) * (n - 64)


def _per_token(cost: float | Callable[[int], float]) -> Callable[[int], float]:
    return cost if callable(cost) else (lambda num_draft_tokens: cost * num_draft_tokens)


def _allocate(alphas, caps, base, model, cost=0.0, budget=None) -> tuple[list[int], float]:
    """The allocator alone: drafts cost `cost` seconds per token (or cost(total))."""
    ks = best_draft_lengths(alphas, caps, _shape(base, budget), model, _per_token(cost))
    return ks, goodput(alphas, ks, _shape(base, budget), model, _per_token(cost))


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
