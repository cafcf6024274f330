"""What drafting costs a step beyond its plain forward, learned online: the overhead of a
speculating step, the draft model's forwards and catch-up, and a correction learned from how
long speculating steps really took against what was predicted for them.

The step-time model (step_time.py) prices the target's forward; every step's forward refines
it, verify steps included. A speculating step can still cost more than the model says in ways
it does not see (a draft model's forwards at a large batch, the model lagging a shape it has
just met), so the ratio of realised to predicted seconds (taken before the step refines the
model) is kept for steps with and without drafts, and a speculating step's predicted forward and
drafting are scaled by their quotient (`correction`): a gain the model's own error would erase
is priced out, and where the model is right (one sequence on a CPU) the correction stays near
1. Both ratios come from decode-shaped steps only (every query token a scored row: decode rows
and drafts, no prompt chunk), so the quotient compares a verify step with the plain step it
replaces: a prompt chunk the model misprices says nothing about drafts, and counted among the
plain steps it turned the correction into a discount (below 1) that bought drafts which cost
more than they earned. Nor is any quotient below 1 a discount: the correction only ever adds
(CORRECTION_BOUNDS). A draft model's catch-up is charged to a decision as the share of it
that the step's tokens buy, but predicted in full for the correction: the step does take all
of it.

A draft model's catch-up is also bounded per step: all of it in one forward would stall the
whole batch for as long as the draft model takes to read a context of hundreds of tokens (seconds
on a CPU), so a step catches up on at most `catch_up_chunk` tokens, a share of the step's own
predicted forward; a request further behind is caught up over several steps and drafts once its
draft KV is current.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.core.drafts import MAX_CATCH_UP_CHUNK
from engine.core.schedule import Candidate, StepShape
from engine.core.stats import StepStats
from engine.policy.acceptance import expected_tokens
from engine.policy.goodput import AffineDraftCost, DraftCost, forward_seconds
from engine.policy.step_time import StepTimePredictor
from engine.speculative_config import MODEL_DRAFTERS

# Weight of the newest measurement in every estimate here (EWMA).
COST_RATE = 0.2
# A first draft forward catching up on at least this many tokens measures the catch-up cost.
MIN_CATCH_UP_SAMPLE = 16
# A draft model's catch-up is paid once and spread over the tokens it buys, counted over at most
# this many: outputs often end (eos) well before max_tokens.
CATCH_UP_HORIZON = 32
# A step's draft-model catch-up (over every request) costs at most this share of its predicted
# forward, and takes at least MIN_CATCH_UP_CHUNK tokens (progress on any host) and at most
# MAX_CATCH_UP_CHUNK (the bound where the cost per token is not known yet).
CATCH_UP_SHARE = 0.5
MIN_CATCH_UP_CHUNK = 16
# Sources that draft with a model: each draft depth costs one batched forward of it.
MODEL_SOURCES = frozenset(MODEL_DRAFTERS)
# The correction stays within these bounds, and fades toward none by this share per step without
# drafts, so speculation is tried again once what made it cost more (a load, a draft model
# catching up) may have passed. It is never a discount (below 1): the model already learns every
# drafting shape from its own steps, so a quotient below 1 is the two ratios' noise (a run of
# plain steps slowed by the host), and where drafts only just pay, that noise decided them: on a
# compute-bound batch of 16 the steps drafted in 98% of the steps priced at 0.9-0.95 and in none
# priced above 1.02 (the step trace's `correction`), at a loss.
CORRECTION_BOUNDS = (1.0, 4.0)
CORRECTION_FADE = 0.01


class DraftCosts:
    """Seconds of drafting, learned from each step's StepStats."""

    def __init__(
        self, draft_forward_seconds: float = 0.0, catch_up_seconds_per_token: float = 0.0
    ) -> None:
        # Starting points timed at start-up, then learned from the draft model's timings.
        self.draft_forward_seconds = draft_forward_seconds
        self.catch_up_seconds_per_token = catch_up_seconds_per_token
        # A drafting step's FIRST forward, learned apart from the chained ones (None until a
        # timing teaches it: then the chained forward's price). It is not one of them: the draft
        # model's reads the tokens accepted since its last drafts (2 to k + 1 a request, dear
        # where every extra row costs), an EAGLE-3 head's one token a request.
        self.first_forward_seconds: float | None = None
        self._overhead = {True: 0.0, False: 0.0}  # seconds outside forward and drafting
        self._error = {True: 1.0, False: 1.0}  # realised over predicted seconds
        self._model_seconds = 0.0  # the draft model's predicted seconds in the step decided

    @property
    def overhead(self) -> float:
        """Extra seconds a step with drafts spends outside the forward and the drafting."""
        return max(0.0, self._overhead[True] - self._overhead[False])

    @property
    def correction(self) -> float:
        low, high = CORRECTION_BOUNDS
        return min(high, max(low, self._error[True] / self._error[False]))

    def catch_up_chunk(self, step_seconds: float) -> int:
        """Tokens of draft-model catch-up a step predicted to take step_seconds may carry."""
        if self.catch_up_seconds_per_token <= 0.0:
            return MAX_CATCH_UP_CHUNK
        tokens = int(CATCH_UP_SHARE * step_seconds / self.catch_up_seconds_per_token)
        return max(MIN_CATCH_UP_CHUNK, min(MAX_CATCH_UP_CHUNK, tokens))

    def model_seconds(
        self,
        candidates: Sequence[Candidate],
        alphas: list[float],
        caps: list[int],
        depth: int,
        amortised: bool = True,
    ) -> float:
        """The draft model's seconds when it drafts `depth` deep for the requests with a cap:
        its forwards plus their catch-up. `amortised` prices the catch-up as each request's
        share of it (what the step pays for the tokens it buys now; the rest buys later steps'
        drafts), else in full (what the step will really take)."""
        if depth == 0:
            return 0.0
        catch_up, best_alpha = 0.0, 0.0
        for c, alpha, cap in zip(candidates, alphas, caps, strict=True):
            if c.source in MODEL_SOURCES and cap > 0:
                best_alpha = max(best_alpha, alpha)
                catch_up += self.catch_up_seconds(c, alpha, cap, amortised)
        # The draft model stops a request at its first unconfident token (where the verify
        # tends to reject), so forward j runs about as often as some request is still accepted
        # so far: the first forward, then E(alpha, depth - 1) - 1 chained ones, not depth - 1.
        chained = self.draft_forward_seconds * (expected_tokens(best_alpha, depth - 1) - 1.0)
        return self.first_seconds + chained + catch_up

    def catch_up_seconds(
        self, candidate: Candidate, alpha: float, cap: int, amortised: bool = True
    ) -> float:
        """The draft model's catch-up on one request drafting up to cap: in full, or amortised,
        the share of it that this step's expected tokens are of the tokens it buys (see
        model_seconds)."""
        share = 1.0
        if amortised:
            left = candidate.request.max_tokens - candidate.request.num_output_tokens
            share = min(1.0, expected_tokens(alpha, cap) / max(1, min(left, CATCH_UP_HORIZON)))
        return self.catch_up_seconds_per_token * candidate.num_catch_up * share

    @property
    def first_seconds(self) -> float:
        """The first forward's price (see first_forward_seconds)."""
        if self.first_forward_seconds is None:
            return self.draft_forward_seconds
        return self.first_forward_seconds

    def step_cost(
        self, model_seconds: float, shape: StepShape, step_model: StepTimePredictor
    ) -> DraftCost:
        """Seconds a step with drafts costs beyond its plain forward: the overhead, the draft
        model's seconds, and the correction's share of the forward and drafting."""
        extra = self.correction - 1.0
        # overhead + model_seconds + extra * (forward + model_seconds), for a step with drafts.
        return AffineDraftCost(
            self.overhead + model_seconds + extra * model_seconds,
            extra,
            0.0,
            lambda m: forward_seconds(shape, step_model, m),
        )

    def alone(self, alpha: float, k: int, uses_model: bool) -> float:
        """Drafting seconds of k drafts for one request alone (the model uncorrected)."""
        chained = self.draft_forward_seconds * (expected_tokens(alpha, k - 1) - 1.0)
        model = self.first_seconds + chained if uses_model else 0.0
        return self.overhead + model

    def decided(self, model_seconds: float) -> None:
        """The draft model's predicted seconds in the step just decided, its catch-up in full:
        the correction compares a step's realised seconds with what the model predicted for that
        step, not with the share of a catch-up the decision charged to it."""
        self._model_seconds = model_seconds

    def observe(self, stats: StepStats, step_model: StepTimePredictor) -> None:
        has_drafts = stats.has_drafts
        shape = (stats.num_tokens, stats.context, stats.num_rows)
        # A step that ran eagerly where graphs serve its size is judged and learned on its own
        # path (engine/policy/step_time.py): the grid prices the graph steps decisions are about.
        eager_price = getattr(step_model, "predict_off_graph", None) if stats.off_graph else None
        predicted = (eager_price or step_model.predict)(*shape)
        if stats.num_tokens and predicted > 0:
            realised = stats.forward_seconds
            if has_drafts:
                realised += stats.draft_seconds
                predicted += self._model_seconds
            else:
                self._error[True] += CORRECTION_FADE * (self._error[False] - self._error[True])
            if stats.num_tokens == stats.num_rows:  # decode-shaped
                self._error[has_drafts] = _ewma(self._error[has_drafts], realised / predicted)
            # Every step's forward refines the model at its own shape: a verify step is a batch
            # of decode-shaped rows at an n plain steps may never reach, where calibration timed
            # one sequence's chunk.
            observe = getattr(step_model, "observe", None)
            if observe is not None:
                path = {"off_graph": True} if eager_price is not None else {}
                observe(*shape[:2], stats.forward_seconds, shape[2], **path)
        self._overhead[has_drafts] = _ewma(self._overhead[has_drafts], stats.overhead_seconds)
        timing = stats.draft_timing
        if timing is not None and timing.num_more:
            per_forward = timing.more_seconds / timing.num_more
            self.draft_forward_seconds = _ewma(self.draft_forward_seconds, per_forward)
        if timing is not None and timing.num_drafting and timing.num_catch_up < MIN_CATCH_UP_SAMPLE:
            # A drafting step's first forward as steps take it, its usual few tokens included.
            first = timing.first_seconds
            last = self.first_forward_seconds
            self.first_forward_seconds = first if last is None else _ewma(last, first)
        if timing is not None and timing.num_catch_up >= MIN_CATCH_UP_SAMPLE:
            # A forward that only catches up (no request drafting yet) has no draft row in it.
            drafting = self.draft_forward_seconds if timing.num_drafting else 0.0
            extra = max(0.0, timing.first_seconds - drafting)
            self.catch_up_seconds_per_token = _ewma(
                self.catch_up_seconds_per_token, extra / timing.num_catch_up
            )


def catch_up_shares(
    candidates: Sequence[Candidate], ks: list[int], behind: list[bool], chunk: int
) -> dict[int, int]:
    """The catch-up tokens of each granted candidate the draft model is too far behind on to
    draft for: the step's chunk, less what the drafting requests catch up on, handed out in
    candidate order (one that gets none waits its turn: still reason catch_up)."""
    left = chunk - sum(
        c.num_catch_up
        for c, k, b in zip(candidates, ks, behind, strict=True)
        if k and not b and c.source in MODEL_SOURCES
    )
    catch_up = {}
    for i, (c, k, b) in enumerate(zip(candidates, ks, behind, strict=True)):
        if k and b:
            catch_up[i] = max(0, min(c.num_catch_up, left))
            left -= catch_up[i]
    return catch_up


def _ewma(value: float, sample: float) -> float:
    return value + COST_RATE * (sample - value)
