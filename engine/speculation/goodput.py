"""The policy's objective and its maximiser: tokens per second of one step, over draft lengths.

goodput(k) = Σ_i E(alpha_i, k_i) / (t(n + Σ k, reads(Σ k), rows + Σ k) + draft seconds(k)),
where n and rows are the step's query tokens and logits rows without drafts, reads its attention's
KV reads with Σ k drafts (each draft reads about a decoding sequence's length; engine/speculation/
step_time.py), E the tokens a verify emits (engine/speculation/acceptance.py) and draft seconds
what proposing the drafts costs.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.speculation.acceptance import expected_tokens
from engine.speculation.step_time import StepTimePredictor

# Seconds the drafting of a step costs, as a function of its total draft tokens (non-decreasing).
DraftCost = Callable[[int], float]


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


def free_drafts(num_draft_tokens: int) -> float:
    return 0.0


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
    tokens = sum(expected_tokens(a, k) for a, k in zip(alphas, ks, strict=True))
    return tokens / seconds if seconds > 0 else math.inf


def best_draft_lengths(
    alphas: Sequence[float],
    caps: Sequence[int],
    shape: StepShape,
    model: StepTimePredictor,
    draft_cost: DraftCost = free_drafts,
) -> list[int]:
    """k_i in 0..caps[i] with Σ k within the budget that maximise the step's goodput.

    Greedy marginal allocation: one draft token at a time goes to the request whose next token is
    likeliest to be accepted (E(alpha, k+1) - E(alpha, k) = alpha^(k+1)); step time depends only on
    the total, so that is also the best goodput increment. The walk goes on past a token that
    lowers goodput (a concave curve can rise again) until no later prefix can win, and the best
    prefix is kept."""
    if len(alphas) != len(caps):
        raise ValueError("alphas and caps differ in length")
    heap = [
        (-a, 0, i) for i, (a, cap) in enumerate(zip(alphas, caps, strict=True)) if cap > 0 and a > 0
    ]
    heapq.heapify(heap)
    # Upper bound on tokens any later prefix can add: every remaining draft accepted as expected.
    tail = sum(expected_tokens(alphas[i], caps[i]) - 1.0 for _, _, i in heap)
    tokens = float(len(alphas))
    best, best_len, picks = -math.inf, 0, list[int]()
    while True:
        seconds = step_seconds(shape, model, draft_cost, len(picks))
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


def step_seconds(
    shape: StepShape, model: StepTimePredictor, draft_cost: DraftCost, num_drafts: int
) -> float:
    """Predicted seconds of the step with num_drafts draft tokens on top, drafting included."""
    return model.predict(
        shape.base_tokens + num_drafts,
        shape.context_with(num_drafts),
        shape.base_rows + num_drafts,
    ) + draft_cost(num_drafts)
