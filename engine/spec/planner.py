"""The speculation policy at work: each step, a draft length k_i per decoding request.

The scheduler hands over the decoding requests it kept this step, each with the most drafts the
step has room for (context, max_tokens), plus the step's token count without drafts, its context
and the budget left. The planner applies, in order:

1. the mode: "off" grants nothing (reason mode_off);
2. caps of 0 with a reason: the request opted out or asked for max_draft_tokens 0
   (request_opt_out), the running batch reached spec_disable_batch_size (batch_size), the device is
   at least spec_disable_utilization busy (utilization);
3. "always": every remaining request gets its cap (reason fixed), while the budget lasts;
   "auto": the goodput allocation of engine/spec/policy.py with hysteresis (reason goodput, or
   compute_bound / low_acceptance for a request left at 0).

It learns online: measured step times refine the step-time model, verify results feed each
request's acceptance estimate (decided by its upper bound, so a request is tried before its
prior can rule it out), measured draft time the draft cost. Every decision is counted in
PolicyStats with its reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.device_monitor import DeviceMonitor
from engine.request import Request
from engine.spec.policy import (
    AcceptanceTracker,
    DraftCost,
    Hysteresis,
    Reason,
    StepTimeModel,
    best_goodput,
    expected_tokens,
    goodput,
)
from engine.spec.stats import PolicyStats

if TYPE_CHECKING:
    from engine.spec.draft_model import DraftTiming

# Weight of the newest measurement in the draft-cost estimate.
_DRAFT_COST_RATE = 0.2
# Speculate only where the predicted goodput beats no drafts by this much per decoding request
# in the step (at most MAX_REQUIRED_GAIN): the step-time model's marginal costs are off by 10-30%
# at large CPU batches (attention over many query rows of many sequences costs more than the
# calibration on one sequence shows), so a small predicted gain at a large batch is often a loss,
# while at batch 1 the model is close.
GAIN_PER_REQUEST = 0.02
MAX_REQUIRED_GAIN = 0.3
# A first draft forward catching up on at least this many tokens measures the catch-up cost.
_MIN_CATCH_UP_SAMPLE = 16
# Sources that draft with a model: each draft depth costs one batched forward of it.
MODEL_SOURCES = frozenset({"draft_model"})


@dataclass(frozen=True)
class Candidate:
    """A decoding request the policy decides for: the most drafts the step has room for (and
    its source can fill), and the source that would draft for it."""

    request: Request
    room: int
    source: str
    num_catch_up: int = 0  # tokens a draft model must catch up on before drafting for it


class DraftPlanner:
    """Chooses k per decoding request per step; see the module docstring."""

    def __init__(
        self,
        mode: str,
        max_draft_tokens: int,
        methods: Sequence[str],
        step_model: StepTimeModel,
        monitor: DeviceMonitor | None = None,
        disable_batch_size: int | None = None,
        disable_utilization: float | None = None,
        draft_forward_seconds: float = 0.0,
        catch_up_seconds_per_token: float = 0.0,
    ) -> None:
        self.mode = mode
        self.max_draft_tokens = max_draft_tokens
        self.methods = tuple(methods)
        self.step_model = step_model
        self.monitor = monitor
        self.disable_batch_size = disable_batch_size
        self.disable_utilization = disable_utilization
        # Seconds of one batched draft-model forward (0 for lookup proposers): a step drafting up
        # to k tokens per request runs about k of them.
        self.draft_forward_seconds = draft_forward_seconds
        self.catch_up_seconds_per_token = catch_up_seconds_per_token
        # Seconds of a step outside the forward and the drafting, with and without drafts.
        self._overhead = {True: 0.0, False: 0.0}
        self.tracker = AcceptanceTracker()
        self.hysteresis = Hysteresis()
        self.stats = PolicyStats()
        self._depth = 0  # the draft model's depth (forwards per step) chosen last step

    def plan(
        self,
        candidates: Sequence[Candidate],
        base_tokens: int,
        context: int,
        budget: int,
        num_running: int,
    ) -> list[int]:
        """k per candidate: its room bounds k; the budget bounds Σ k."""
        caps: list[int] = []
        reasons: list[Reason | None] = []
        utilization = self._utilization(base_tokens)
        for c in candidates:
            cap, reason = self._cap(c.request, c.room, num_running, utilization)
            caps.append(cap)
            reasons.append(reason)
        if self.mode == "auto":
            ks, final = self._auto(candidates, caps, reasons, base_tokens, context, budget)
        else:
            ks, final = self._fixed(caps, reasons, budget)
        self._record(ks, final)
        return ks

    def _cap(
        self, request: Request, room: int, num_running: int, utilization: float | None
    ) -> tuple[int, Reason | None]:
        params = request.params
        if not params.speculate or params.max_draft_tokens == 0:
            return 0, "request_opt_out"
        if self.disable_batch_size is not None and num_running >= self.disable_batch_size:
            return 0, "batch_size"
        limit = self.disable_utilization
        if limit is not None and utilization is not None and utilization >= limit:
            return 0, "utilization"
        cap = min(room, self.max_draft_tokens)
        if params.max_draft_tokens is not None:
            cap = min(cap, params.max_draft_tokens)
        return cap, None

    def _utilization(self, base_tokens: int) -> float | None:
        if self.disable_utilization is None or self.monitor is None:
            return None
        return self.monitor.utilization(base_tokens)

    def _fixed(
        self, caps: list[int], reasons: list[Reason | None], budget: int
    ) -> tuple[list[int], list[str]]:
        ks, final = [], []
        for cap, reason in zip(caps, reasons, strict=True):
            if self.mode == "off":
                ks.append(0)
                final.append("mode_off")
                continue
            k = max(0, min(cap, budget))
            budget -= k
            ks.append(k)
            final.append("fixed" if k > 0 else (reason or "budget"))
        return ks, final

    def _auto(
        self,
        candidates: Sequence[Candidate],
        caps: list[int],
        reasons: list[Reason | None],
        base_tokens: int,
        context: int,
        budget: int,
    ) -> tuple[list[int], list[str]]:
        """Goodput allocation. A draft model's cost is one batched forward per draft depth,
        whoever drafts that deep, so each depth D (0 = the model idle) is tried: model-drafted
        requests capped at D, the cost D forwards; lookup drafts cost nothing. The best D's
        caps then go through the hysteresis."""
        ids = [self._key(c) for c in candidates]
        alphas = [
            self.tracker.upper_bound(key, c.source) for key, c in zip(ids, candidates, strict=True)
        ]
        uses_model = [c.source in MODEL_SOURCES for c in candidates]
        depths = max((cap for cap, m in zip(caps, uses_model, strict=True) if m), default=0)
        values = []
        for depth in range(depths + 1):
            depth_caps = _depth_caps(caps, uses_model, depth)
            values.append(
                best_goodput(
                    alphas, depth_caps, base_tokens, context, self.step_model,
                    _constant(self._model_cost(candidates, alphas, depth_caps, depth)), budget,
                )
            )  # fmt: skip
        depth = max(range(depths + 1), key=values.__getitem__)
        # The depth has its own hysteresis: the last one is kept unless the new one clears
        # the margin (switching the draft model on and off costs catch-up forwards).
        last = min(self._depth, depths)
        if values[last] * (1.0 + self.hysteresis.margin) >= values[depth]:
            depth = last
        self._depth = depth
        depth_caps = _depth_caps(caps, uses_model, depth)
        cost = self._model_cost(candidates, alphas, depth_caps, depth)
        allocation = self.hysteresis.allocate(
            ids, alphas, depth_caps, base_tokens, context, self.step_model, _constant(cost),
            _filled(reasons, depth_caps), max_num_draft_tokens=budget,
        )  # fmt: skip
        ks = list(allocation.num_draft_tokens)
        plain = goodput(alphas, [0] * len(ks), base_tokens, context, self.step_model, 0.0)
        required = min(MAX_REQUIRED_GAIN, GAIN_PER_REQUEST * len(ks))
        if any(ks) and allocation.goodput < plain * (1.0 + required):
            # A gain the model's own error could erase is not worth the verify work.
            ks = [0] * len(ks)
            reasons = [r or "compute_bound" for r in reasons]
        final = [
            "goodput"
            if k > 0
            else reasons[i]
            or (
                self._model_reason(alphas[i], caps[i], context)
                if uses_model[i]
                else allocation.reasons[i]
            )
            for i, k in enumerate(ks)
        ]
        return ks, final

    def _model_cost(
        self, candidates: Sequence[Candidate], alphas: list[float], caps: list[int], depth: int
    ) -> float:
        """Seconds a step with drafts costs beyond its target forward: the measured overhead of
        speculating steps, and for a draft model drafting `depth` deep one batched forward per
        depth, plus each drafting request's catch-up — a one-time cost, spread over the steps it
        buys (its remaining tokens at E(alpha, k) tokens per step)."""
        if depth == 0:
            return self.speculation_overhead
        catch_up, best_alpha = 0.0, 0.0
        for c, alpha, cap in zip(candidates, alphas, caps, strict=True):
            if c.source in MODEL_SOURCES and cap > 0:
                best_alpha = max(best_alpha, alpha)
                # Outputs often end (eos) well before max_tokens: a short horizon.
                remaining = max(1, min(c.request.max_tokens - c.request.num_output_tokens, 32))
                share = min(1.0, expected_tokens(alpha, cap) / remaining)
                catch_up += self.catch_up_seconds_per_token * c.num_catch_up * share
        # The draft model stops a request at its first unconfident token (which tends to be
        # where verification would reject), so forward j runs about as often as some request
        # is still accepted-so-far: expected forwards E(alpha, depth - 1), not depth.
        forwards = self.draft_forward_seconds * expected_tokens(best_alpha, depth - 1)
        return self.speculation_overhead + forwards + catch_up

    def _model_reason(self, alpha: float, cap: int, context: int) -> str:
        """Why a model-drafted request got no drafts: compute_bound when drafting some depth
        would pay for it alone in this step (the batch's load stopped it), else low_acceptance."""
        alone = goodput([alpha], [0], 1, context, self.step_model, 0.0)
        for depth in range(1, cap + 1):
            cost = self.draft_forward_seconds * expected_tokens(alpha, depth - 1)
            if goodput([alpha], [depth], 1, context, self.step_model, cost / depth) > alone:
                return "compute_bound"
        return "low_acceptance"

    @staticmethod
    def _key(candidate: Candidate) -> str:
        # One acceptance estimate per request and source: n-gram and a draft model differ.
        return f"{candidate.request.request_id}/{candidate.source}"

    def _record(self, ks: list[int], reasons: list[str]) -> None:
        stats = self.stats
        stats.num_requests_decoding = len(ks)
        stats.num_requests_speculating = sum(1 for k in ks if k > 0)
        for k, reason in zip(ks, reasons, strict=True):
            stats.record(k, "speculate" if k > 0 else "skip", reason)

    # ------------------------------------------------------------------------ online learning

    def observe_step(self, num_tokens: int, context: int, seconds: float) -> None:
        self.step_model.observe(num_tokens, context, seconds)

    def observe_draft_time(self, timing: DraftTiming) -> None:
        """Learn the draft model's costs: the single-token forwards give the per-depth cost,
        a first forward that caught up on many tokens the per-token catch-up cost."""
        if timing.num_more:
            self.draft_forward_seconds = _ewma(
                self.draft_forward_seconds, timing.more_seconds / timing.num_more
            )
        if timing.num_catch_up >= _MIN_CATCH_UP_SAMPLE:
            extra = max(0.0, timing.first_seconds - self.draft_forward_seconds)
            self.catch_up_seconds_per_token = _ewma(
                self.catch_up_seconds_per_token, extra / timing.num_catch_up
            )

    def observe_overhead(self, seconds: float, has_drafts: bool) -> None:
        self._overhead[has_drafts] = _ewma(self._overhead[has_drafts], seconds)

    @property
    def speculation_overhead(self) -> float:
        """Extra seconds a step with drafts spends outside the forward and the drafting."""
        return max(0.0, self._overhead[True] - self._overhead[False])

    def observe_verify(
        self, request: Request, source: str, num_draft_tokens: int, num_accepted: int
    ) -> None:
        key = self._key(Candidate(request, 0, source))
        self.tracker.observe(key, source, num_draft_tokens, num_accepted)

    def forget(self, request: Request) -> None:
        for source in (*self.methods, "prediction"):
            key = self._key(Candidate(request, 0, source))
            self.tracker.forget(key)
            self.hysteresis.forget(key)


def _ewma(value: float, sample: float) -> float:
    return value + _DRAFT_COST_RATE * (sample - value)


def _depth_caps(caps: list[int], uses_model: list[bool], depth: int) -> list[int]:
    return [min(cap, depth) if m else cap for cap, m in zip(caps, uses_model, strict=True)]


def _constant(seconds: float) -> DraftCost:
    return lambda num_draft_tokens: seconds if num_draft_tokens > 0 else 0.0


def _filled(reasons: list[Reason | None], caps: list[int]) -> list[Reason | None]:
    """Reasons for every cap of 0: a model-drafted request capped by the depth is compute_bound
    for this step (its draft forwards did not pay)."""
    return [
        r if r is not None or cap > 0 else "compute_bound"
        for r, cap in zip(reasons, caps, strict=True)
    ]
