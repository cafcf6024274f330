"""The acceptance estimate: expected tokens as the geometric sum, and the tracker on seeded
synthetic verifies (it converges to the true alpha, its prior, decay and forgetting, its upper
bound's width, and a model drafter's new request pooled from its recent requests)."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from engine.policy.acceptance import (
    ACCEPTANCE_DECAY,
    PRIOR_WEIGHT,
    AcceptanceTracker,
    expected_tokens,
)


def test_expected_tokens_is_the_geometric_sum() -> None:
    assert expected_tokens(0.8, 3) == pytest.approx(1 + 0.8 + 0.64 + 0.512)
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 0) == 1.0
    for alpha, k in itertools.product([0.1, 0.5, 0.9, 0.999], range(8)):
        assert expected_tokens(alpha, k) == pytest.approx(sum(alpha**j for j in range(k + 1)))
    with pytest.raises(ValueError):
        expected_tokens(1.2, 3)


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
