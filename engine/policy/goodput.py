"""The policy's objective and its maximiser: tokens per second of one step, over draft lengths.

goodput(k) = (rows - m + Σ_i E(alpha_i, k_i)) / (t(n + Σ k, reads(Σ k), rows + Σ k) + draft seconds(k)),
where n and rows are the step's query tokens and logits rows without drafts (every row emits a
token; m of them are the candidates, whose rows emit E(alpha_i, k_i)), reads its attention's
KV reads with Σ k drafts (each draft reads about a decoding sequence's length; engine/policy/
step_time.py), E the tokens a verify emits (engine/policy/acceptance.py) and draft seconds
what proposing the drafts costs.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.core.schedule import StepShape
from engine.policy.acceptance import expected_tokens
from engine.policy.step_time import StepTimePredictor

# Seconds the drafting of a step costs, as a function of its total draft tokens (non-decreasing).
DraftCost = Callable[[int], float]


def free_drafts(num_draft_tokens: int) -> float:
    return 0.0


@dataclass(frozen=True)
class AffineDraftCost:
    """A DraftCost affine in the step's forward: `with_drafts + per_forward * t(step)` seconds
    for a step with drafts, `without` for one with none; `forward(m)` is t of the step with m
    drafts (needed only when per_forward is not 0). The allocator reads the coefficients and
    prices a step with one prediction; called, it is any DraftCost."""

    with_drafts: float
    per_forward: float = 0.0
    without: float = 0.0
    forward: Callable[[int], float] | None = None

    def __call__(self, num_draft_tokens: int) -> float:
        if not num_draft_tokens:
            return self.without
        if not self.per_forward:
            return self.with_drafts
        assert self.forward is not None
        return self.with_drafts + self.per_forward * self.forward(num_draft_tokens)

    def plus(self, seconds: float) -> AffineDraftCost:
        """This cost and `seconds` the step pays whatever it drafts."""
        return AffineDraftCost(
            self.with_drafts + seconds, self.per_forward, self.without + seconds, self.forward
        )


def forward_seconds(shape: StepShape, model: StepTimePredictor, num_drafts: int) -> float:
    """Predicted forward seconds of the shape's step with num_drafts draft tokens on top."""
    return model.predict(
        shape.base_tokens + num_drafts,
        shape.context_with(num_drafts),
        shape.base_rows + num_drafts,
    )


def goodput(
    alphas: Sequence[float],
    ks: Sequence[int],
    shape: StepShape,
    model: StepTimePredictor,
    draft_cost: DraftCost = free_drafts,
) -> float:
    """Predicted tokens per second of a step that verifies ks on top of the shape's tokens."""
    num_drafts = sum(ks)
    seconds = step_seconds(shape, model, draft_cost, num_drafts)
    tokens = other_rows(shape, len(alphas)) + sum(
        expected_tokens(a, k) for a, k in zip(alphas, ks, strict=True)
    )
    return tokens / seconds if seconds > 0 else math.inf


def other_rows(shape: StepShape, num_candidates: int) -> int:
    """The step's sampling rows that are no candidate's (requests no source drafts for, paused
    lookups, a prompt's last chunk): each emits its token whatever the candidates draft, so a
    step's goodput counts them (ignored, a few candidates among many rows would read their
    drafts' worth against their own tokens only, and draft where the step cannot gain)."""
    return max(shape.base_rows - num_candidates, 0)


def best_draft_lengths(
    alphas: Sequence[float],
    caps: Sequence[int],
    shape: StepShape,
    model: StepTimePredictor,
    draft_cost: DraftCost = free_drafts,
    forwards: dict[int, float] | None = None,
) -> list[int]:
    """k_i in 0..caps[i] with Σ k within the budget that maximise the step's goodput.

    Greedy marginal allocation: one draft token at a time goes to the request whose next token is
    likeliest to be accepted (E(alpha, k+1) - E(alpha, k) = alpha^(k+1)); step time depends only on
    the total, so that is also the best goodput increment. The walk goes on past a token that
    lowers goodput (a concave curve can rise again) until no later prefix can win, and the best
    prefix is kept. `forwards`: the forward seconds of the shape's step with m drafts, by m, kept
    across calls on one shape and model (the policy allocates once per draft-model depth)."""
    if len(alphas) != len(caps):
        raise ValueError("alphas and caps differ in length")
    heap = [
        (-a, 0, i) for i, (a, cap) in enumerate(zip(alphas, caps, strict=True)) if cap > 0 and a > 0
    ]
    heapq.heapify(heap)
    # Upper bound on tokens any later prefix can add: every remaining draft accepted as expected.
    tail = sum(expected_tokens(alphas[i], caps[i]) - 1.0 for _, _, i in heap)
    tokens = float(len(alphas) + other_rows(shape, len(alphas)))
    best, best_len, picks = -math.inf, 0, list[int]()
    seconds_at = _pricer(shape, model, draft_cost, forwards)
    while True:
        seconds = seconds_at(len(picks))
        value = tokens / seconds if seconds > 0 else math.inf
        if value > best:
            best, best_len = value, len(picks)
        # Step time never falls as drafts are added, so this bounds every longer prefix.
        if not heap or len(picks) >= shape.budget or (tokens + tail) / seconds <= best:
            break
        neg_gain, k, i = heapq.heappop(heap)
        picks.append(i)
        tokens -= neg_gain
        tail += neg_gain
        if k + 1 < caps[i]:
            heapq.heappush(heap, (-(alphas[i] ** (k + 2)), k + 1, i))
    ks = [0] * len(alphas)
    for i in picks[:best_len]:
        ks[i] += 1
    return ks


def _pricer(
    shape: StepShape,
    model: StepTimePredictor,
    draft_cost: DraftCost,
    forwards: dict[int, float] | None = None,
) -> Callable[[int], float]:
    """step_seconds(shape, model, draft_cost, m) as a function of m; for an AffineDraftCost
    one prediction (or, with `forwards`, a lookup of it) and two products, with no call through
    the cost (the allocator asks for hundreds of m a step at a large batch)."""
    if not isinstance(draft_cost, AffineDraftCost):
        return lambda m: step_seconds(shape, model, draft_cost, m)
    predict, reads = model.predict, shape.reads_per_draft
    tokens, rows, context = shape.base_tokens, shape.base_rows, shape.context
    with_drafts, scale, without = (
        draft_cost.with_drafts,
        1.0 + draft_cost.per_forward,
        draft_cost.without,
    )
    known = {} if forwards is None else forwards

    def seconds(m: int) -> float:
        forward = known.get(m)
        if forward is None:
            forward = known[m] = predict(tokens + m, context + round(m * reads), rows + m)
        return forward * scale + with_drafts if m else forward + without

    return seconds


def step_seconds(
    shape: StepShape, model: StepTimePredictor, draft_cost: DraftCost, num_drafts: int
) -> float:
    """Predicted seconds of the step with num_drafts draft tokens on top, drafting included."""
    return model.predict(
        shape.base_tokens + num_drafts,
        shape.context_with(num_drafts),
        shape.base_rows + num_drafts,
    ) + draft_cost(num_drafts)


def plus_fixed(cost: DraftCost, seconds: float) -> DraftCost:
    """cost, plus seconds the step pays whatever it drafts."""
    if not seconds:
        return cost
    if isinstance(cost, AffineDraftCost):
        return cost.plus(seconds)
    return lambda num_draft_tokens: cost(num_draft_tokens) + seconds
