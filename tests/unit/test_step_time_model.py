"""The fitted step-time model: a fit recovers a known curve and stays monotone, repairs
non-monotone measurements, follows a slower device, does not ratchet a burst's neighbours up,
round-trips through its dict, and verify steps refine it at their own shape."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from engine.core.stats import StepStats, VerifyResult
from engine.policy.policy import SpeculationPolicy
from engine.policy.step_time import StepTimeModel


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


def test_eager_steps_beside_graphs_are_learned_apart() -> None:
    """A step that ran eagerly where graphs serve its size (a prompt chunk beside decodes on
    flash-attn) is slower than the graph steps decisions are about: it teaches the eager table
    and leaves the grid alone (the H200 run's t(64) rose from 4.8 to 17.6 ms when both were one)."""
    model = StepTimeModel([1, 16, 64], [1.0, 1.2, 2.0])
    policy = SpeculationPolicy("auto", 7, model)
    graph = StepStats((), (), 16, 16, 0, 1.2, 0.0, 0.0)
    eager = StepStats((), (), 64, 2, 0, 8.0, 0.0, 0.0, off_graph=True)
    for _ in range(80):
        policy.observe(graph)
        policy.observe(eager)
    assert model.predict(64) == pytest.approx(2.0)  # the grid as the graph steps left it
    assert model.predict(16, 0, 16) == pytest.approx(1.2, rel=0.02)
    assert model.predict_off_graph(64) == pytest.approx(8.0, rel=0.02)
    # The correction judges each step on its own path: neither is mispriced once learned.
    assert policy.costs.correction == pytest.approx(1.0, abs=0.05)
    # Before any eager step, they are priced as the graph grid says; a rescale starts over.
    fresh = StepTimeModel([1, 16, 64], [1.0, 1.2, 2.0])
    assert fresh.predict_off_graph(64) == fresh.predict(64)
    model.rescale([1.0, 1.0, 1.0])
    assert model.predict_off_graph(64) == model.predict(64) == 1.0
