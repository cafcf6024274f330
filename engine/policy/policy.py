"""The speculation policy: each step, a draft length k and one reason per decoding request.

One model decides. The step-time model (step_time.py) prices the target's forward, the drafting
costs (costs.py: the overhead of speculating, the draft model's forwards and catch-up, and the
learned correction of speculating steps' cost) the rest, each request's acceptance estimate
(acceptance.py) says what its drafts would earn, and the allocation maximises the step's goodput
(goodput.py). Before it, operator limits and opt-outs cap k; after it, a switch (a request on or
off, the draft model deeper or shallower) is held back unless it gains more than SWITCH_MARGIN.
The modes: "auto" is all of the above, "always" grants every cap while the budget lasts, "off"
grants nothing.

Every decision carries one reason from the vocabulary in engine/core/stats.py, decided
here. The scheduler may still cut a grant the KV pool cannot hold, so the policy learns from, and
the metrics count, the final decisions of the step's StepStats (`observe`), which also bring the
measured step time (the step-time model), verify results and shadow drafts (the acceptance
estimates), draft-model timings (its costs) and the step's overhead outside the forward.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from engine.core.schedule import Candidate, StepShape, acceptance_key
from engine.core.stats import Decision, StepStats
from engine.policy.acceptance import AcceptanceTracker, expected_tokens
from engine.policy.costs import MODEL_SOURCES, DraftCosts, catch_up_shares
from engine.policy.device_monitor import DeviceMonitor
from engine.policy.goodput import (
    DraftCost,
    best_draft_lengths,
    forward_seconds,
    goodput,
    other_rows,
    plus_fixed,
    step_seconds,
)
from engine.policy.step_time import MemoPredictor, StepTimeModel, StepTimePredictor
from engine.speculative_config import check_mode

# A switch is taken only when it gains more than this share of the goodput (for a request's
# on/off, of its share of the step's; for the draft model's depth, of the step's): around
# break-even the estimates wobble step to step, and a switch has costs the model does not see (a
# draft model catching up, a cold n-gram index).
SWITCH_MARGIN = 0.03


class SpeculationPolicy:
    """Decides k per decoding request per step; learns from each step's StepStats."""

    def __init__(
        self,
        mode: str,
        max_draft_tokens: int,
        step_model: StepTimeModel,
        monitor: DeviceMonitor | None = None,
        disable_batch_size: int | None = None,
        disable_utilization: float | None = None,
        draft_forward_seconds: float = 0.0,
        catch_up_seconds_per_token: float = 0.0,
        is_calibrated: bool = True,
    ) -> None:
        self.mode = mode
        # Whether step_model was measured on this device (auto needs it; off and always do not).
        self.is_calibrated = is_calibrated
        self.max_draft_tokens = max_draft_tokens
        self.step_model = step_model
        # What one decision prices steps with: the step model, each prediction made once (the
        # allocation asks for the same step sizes at every draft-model depth).
        self._prices: StepTimePredictor = step_model
        self.monitor = monitor
        self.disable_batch_size = disable_batch_size
        self.disable_utilization = disable_utilization
        self.costs = DraftCosts(draft_forward_seconds, catch_up_seconds_per_token)
        self.tracker = AcceptanceTracker(pooled=MODEL_SOURCES)
        self._last_k: dict[str, int] = {}  # acceptance key -> k of its last final decision
        self._depth = 0  # the draft model's depth (forwards per step) in the last step

    def set_mode(self, mode: str) -> None:
        """Switch the mode between steps (an operator's call, `PUT /internal/speculation`).
        What was learned is kept; auto needs a step-time model calibrated at start."""
        check_mode(mode)
        if mode == "auto" and not self.is_calibrated:
            raise ValueError(
                "mode auto needs the step-time model calibrated at start: start the server "
                "with speculative_config.mode auto."
            )
        self.mode = mode

    # ---------------------------------------------------------------------------- deciding

    def decide(self, candidates: Sequence[Candidate], shape: StepShape) -> list[Decision]:
        """One decision per candidate: k within its room, Σ k within the shape's budget."""
        self._prices = MemoPredictor(self.step_model)
        utilization = None
        if self.disable_utilization is not None and self.monitor is not None:
            utilization = self.monitor.utilization(shape.base_tokens)
        caps: list[int] = []
        limits: list[str | None] = []  # the operator limit that capped each, if any
        for c in candidates:
            cap, reason = self._cap(c, shape.num_running, utilization)
            caps.append(cap)
            limits.append(reason)
        chunk = self.costs.catch_up_chunk(
            self.step_model.predict(shape.base_tokens, shape.context, shape.base_rows)
        )
        # A draft model further behind on a request than a step may catch up cannot draft for it
        # this step: what it is granted buys a chunk of catch-up instead (catch_up_shares).
        behind = [c.source in MODEL_SOURCES and c.num_catch_up > chunk for c in candidates]
        reasons: list[str]
        if self.mode == "auto":
            ks, reasons, catch_up = self._auto(candidates, caps, limits, shape, behind, chunk)
        else:
            ks, budget = [], shape.budget
            for cap in caps:
                ks.append(0 if self.mode == "off" else max(0, min(cap, budget)))
                budget -= ks[-1]
            if self.mode == "off":
                reasons = ["mode_off"] * len(caps)
            else:
                reasons = [
                    r or ("fixed" if k else "budget") for k, r in zip(ks, limits, strict=True)
                ]
            catch_up = catch_up_shares(candidates, ks, behind, chunk)
            for i in catch_up:
                ks[i], reasons[i] = 0, "catch_up"
        return [
            Decision(
                c.request.request_id,
                c.source,
                k,
                r,
                catch_up.get(i, c.num_catch_up if k and c.source in MODEL_SOURCES else 0),
            )
            for i, (c, k, r) in enumerate(zip(candidates, ks, reasons, strict=True))
        ]

    def _cap(
        self, candidate: Candidate, num_running: int, utilization: float | None
    ) -> tuple[int, str | None]:
        params = candidate.request.params
        if not params.speculate or params.max_draft_tokens == 0:
            return 0, "request_opt_out"
        if self.disable_batch_size is not None and num_running >= self.disable_batch_size:
            return 0, "batch_size"
        limit = self.disable_utilization
        if limit is not None and utilization is not None and utilization >= limit:
            return 0, "utilization"
        cap = min(candidate.room, self.max_draft_tokens, params.max_draft_tokens or candidate.room)
        return cap, None

    def _auto(
        self,
        candidates: Sequence[Candidate],
        caps: list[int],
        reasons: list[str | None],
        shape: StepShape,
        behind: list[bool],
        chunk: int,
    ) -> tuple[list[int], list[str], dict[int, int]]:
        """The goodput allocation; a request the draft model is behind on is valued as if it
        could draft now, its whole catch-up charged as the share of it the drafts buy (whether
        catching up pays); granted, it gets a chunk of catch-up instead, and the others are
        allocated again with that chunk's seconds paid by the step whatever it drafts."""
        uses_model = [c.source in MODEL_SOURCES for c in candidates]
        alphas = [self._acceptance(c, m) for c, m in zip(candidates, uses_model, strict=True)]
        ks, model_seconds = self._allocate(candidates, alphas, caps, uses_model, shape)
        catch_up = catch_up_shares(candidates, ks, behind, chunk)
        fixed = 0.0
        if catch_up:
            fixed = self.costs.catch_up_seconds_per_token * sum(catch_up.values())
            caps = [0 if i in catch_up else cap for i, cap in enumerate(caps)]
            ks, model_seconds = self._allocate(candidates, alphas, caps, uses_model, shape, fixed)
        self.costs.decided(model_seconds + fixed)
        final = []
        why: dict[tuple[float, int, bool], float] = {}  # requests alike share their margin
        alone: list[float] = []  # t(1 + k) of one sequence alone, by k: every request's the same
        for i, limit in enumerate(reasons):
            if i in catch_up:
                final.append("catch_up")
            elif ks[i]:
                final.append("goodput")
            elif limit is not None:
                final.append(limit)
            elif sum(ks) >= shape.budget:
                final.append("budget")
            else:
                final.append(self._why_not(candidates[i], alphas[i], caps[i], shape, why, alone))
        return ks, final, catch_up

    def _allocate(
        self,
        candidates: Sequence[Candidate],
        alphas: list[float],
        caps: list[int],
        uses_model: list[bool],
        shape: StepShape,
        fixed: float = 0.0,
    ) -> tuple[list[int], float]:
        """k per candidate, and the draft model's seconds for them (catch-up in full). A draft
        model costs one batched forward per depth, whoever drafts that deep, so each depth D (0:
        the model idle) is priced with model-drafted caps cut to D; lookup drafts cost only the
        overhead of speculating. `fixed`: seconds the step takes whatever is drafted."""
        deepest = max((cap for cap, m in zip(caps, uses_model, strict=True) if m), default=0)
        forwards: dict[int, float] = {}  # the step's forward by its drafts, for every depth

        def allocation(depth: int) -> tuple[list[int], list[int], DraftCost, float]:
            depth_caps = [
                min(cap, depth) if m else cap for cap, m in zip(caps, uses_model, strict=True)
            ]
            model_seconds = self.costs.model_seconds(candidates, alphas, depth_caps, depth)
            cost = plus_fixed(self.costs.step_cost(model_seconds, shape, self._prices), fixed)
            ks = best_draft_lengths(alphas, depth_caps, shape, self._prices, cost, forwards)
            # Valued with the catch-up of the requests that draft, not of every one that could.
            cost = plus_fixed(
                self.costs.step_cost(
                    self.costs.model_seconds(candidates, alphas, ks, depth), shape, self._prices
                ),
                fixed,
            )
            return ks, depth_caps, cost, goodput(alphas, ks, shape, self._prices, cost)

        options = [allocation(depth) for depth in range(deepest + 1)]
        depth = max(range(deepest + 1), key=lambda d: options[d][3])
        last = min(self._depth, deepest)
        if options[last][3] * (1.0 + SWITCH_MARGIN) >= options[depth][3]:
            depth = last
        ks, depth_caps, cost, _ = options[depth]
        ks = self._hold(candidates, alphas, depth_caps, ks, shape, cost)
        drafted = max((k for k, m in zip(ks, uses_model, strict=True) if m), default=0)
        return ks, self.costs.model_seconds(candidates, alphas, ks, drafted, False)

    def _acceptance(self, candidate: Candidate, uses_model: bool) -> float:
        """What a request's drafts are judged by. A draft model learns only by drafting, so its
        upper bound: optimism that tries a request its prior rules out. A lookup learns while
        paused too (its shadow drafts), so its estimate itself: at a large batch, where drafts
        only just pay, a standing bonus over ten or so shadows' evidence bought drafts that the
        verify then showed did not pay."""
        if uses_model:
            return self.tracker.upper_bound(candidate.key, candidate.source)
        return self.tracker.alpha(candidate.key, candidate.source)

    def _hold(
        self,
        candidates: Sequence[Candidate],
        alphas: list[float],
        caps: list[int],
        ks: list[int],
        shape: StepShape,
        cost: DraftCost,
    ) -> list[int]:
        """Keep each request's last on/off state (staying on: its last k, within its cap) unless
        switching gains more than SWITCH_MARGIN of the request's share of the step's goodput.
        Caps of 0 act at once."""
        tokens = [expected_tokens(a, k) for a, k in zip(alphas, ks, strict=True)]
        total, num_drafts = sum(tokens) + other_rows(shape, len(ks)), sum(ks)

        def value(tokens: float, num_drafts: int) -> float:
            seconds = step_seconds(shape, self._prices, cost, num_drafts)
            return tokens / seconds if seconds > 0 else math.inf

        # Each switch is judged against the allocation as held so far, by the totals alone: a
        # step's goodput is its expected tokens over the seconds of its draft count, so no
        # candidate costs more than two predictions (summing the batch per candidate took 6 ms a
        # step at 64 requests on a GPU host, beside a 7-ms forward).
        # A request's share: of every row the step samples, candidate or not (a paused lookup
        # is none; engine/drafters/speculator.py), so a few candidates do not hold a lot each.
        allowance = SWITCH_MARGIN * value(total, num_drafts) / max(len(ks), shape.base_rows)
        ks = list(ks)
        for i, c in enumerate(candidates):
            last = self._last_k.get(c.key)
            if last is None or caps[i] <= 0 or (last > 0) == (ks[i] > 0):
                continue
            held = min(last, caps[i])
            if ks[i] == 0 and num_drafts + held > shape.budget:
                continue
            held_tokens = expected_tokens(alphas[i], held)
            other_total = total - tokens[i] + held_tokens
            other_drafts = num_drafts - ks[i] + held
            if value(total, num_drafts) - value(other_total, other_drafts) <= allowance:
                ks[i], tokens[i], total, num_drafts = held, held_tokens, other_total, other_drafts
        return ks

    def _why_not(
        self,
        candidate: Candidate,
        alpha: float,
        cap: int,
        shape: StepShape,
        memo: dict[tuple[float, int, bool], float] | None = None,
        alone: list[float] | None = None,
    ) -> str:
        """A request left at 0 is compute_bound when drafting would pay for it alone, one
        decoding sequence as long as this step's, its draft model's catch-up charged as the
        allocation charges it (the batch's load stopped it); catch_up_cost when it would pay
        alone once the draft model is current but not with the catch-up to get there; else
        low_acceptance.

        Alone, k drafts pay when E(alpha, k) / (t(1 + k) + s(k) + catch_up) > 1 / t(1), i.e.
        when E(alpha, k) t(1) - t(1 + k) - s(k) > catch_up: the best such margin over k depends
        on the request's alpha and cap alone, so requests alike share it (`memo`, one decision's)
        and each compares its own catch-up with it; the forwards t(1 + k) are every request's
        (`alone`, one decision's, filled as far as a cap needs)."""
        uses_model = candidate.source in MODEL_SOURCES
        key = (alpha, cap, uses_model)
        margin = memo.get(key) if memo is not None else None
        if margin is None:
            margin = self._best_margin_alone(alpha, cap, uses_model, shape, alone)
            if memo is not None:
                memo[key] = margin
        catch_up = self.costs.catch_up_seconds(candidate, alpha, cap) if uses_model else 0.0
        if margin > catch_up:
            return "compute_bound"
        return "catch_up_cost" if catch_up > 0.0 and margin > 0.0 else "low_acceptance"

    def _best_margin_alone(
        self,
        alpha: float,
        cap: int,
        uses_model: bool,
        shape: StepShape,
        alone: list[float] | None = None,
    ) -> float:
        """max over k in 1..cap of E(alpha, k) t(1) - t(1 + k) - s(k), seconds (see _why_not);
        -inf when cap is 0. `alone`: t(1 + k) by k, extended here as far as cap."""
        forwards = [] if alone is None else alone
        if len(forwards) <= cap:
            length = round(shape.reads_per_draft)
            single = StepShape(1, 1, length, cap, 1, reads_per_draft=shape.reads_per_draft)
            forwards.extend(
                forward_seconds(single, self._prices, k) for k in range(len(forwards), cap + 1)
            )
        plain = forwards[0]
        best = -math.inf
        for k in range(1, cap + 1):
            drafting = self.costs.alone(alpha, k, uses_model)
            best = max(best, expected_tokens(alpha, k) * plain - forwards[k] - drafting)
        return best

    # ---------------------------------------------------------------------------- learning

    def observe(self, stats: StepStats) -> None:
        """Learn from one finished step (its device time synchronised)."""
        self.costs.observe(stats, self.step_model)
        self.tracker.tick()
        for v in stats.verifies:
            key = acceptance_key(v.request_id, v.source)
            self.tracker.observe(key, v.source, v.num_draft_tokens, v.num_accepted)
        depth = 0
        for d in stats.decisions:
            self._last_k[acceptance_key(d.request_id, d.source)] = d.num_draft_tokens
            if d.source in MODEL_SOURCES:
                depth = max(depth, d.num_draft_tokens)
        self._depth = depth

    def forget(self, request_id: str) -> None:
        for source in self.tracker.priors:
            key = acceptance_key(request_id, source)
            self.tracker.forget(key)
            self._last_k.pop(key, None)
