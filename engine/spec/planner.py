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
request's acceptance estimate, measured draft time the draft cost. Every decision is counted in
PolicyStats with its reason.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from engine.device_monitor import DeviceMonitor
from engine.request import Request
from engine.spec.policy import AcceptanceTracker, Hysteresis, Reason, StepTimeModel
from engine.spec.stats import PolicyStats

# Weight of the newest measurement in the draft-cost estimate.
_DRAFT_COST_RATE = 0.2


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
        self.tracker = AcceptanceTracker()
        self.hysteresis = Hysteresis()
        self.stats = PolicyStats()
        self._method: dict[str, str] = {}  # request id -> source of its latest draft

    def can_draft(self, request: Request) -> bool:
        """Whether any proposer could draft for the request (a chain, or its own prediction)."""
        return bool(self.methods or request.prediction_token_ids)

    def plan(
        self,
        candidates: Sequence[tuple[Request, int]],
        base_tokens: int,
        context: int,
        budget: int,
        num_running: int,
    ) -> list[int]:
        """k per candidate (request, room): room bounds k; budget bounds Σ k."""
        caps: list[int] = []
        reasons: list[Reason | None] = []
        utilization = self._utilization(base_tokens)
        for request, room in candidates:
            cap, reason = self._cap(request, room, num_running, utilization)
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
        candidates: Sequence[tuple[Request, int]],
        caps: list[int],
        reasons: list[Reason | None],
        base_tokens: int,
        context: int,
        budget: int,
    ) -> tuple[list[int], list[str]]:
        ids = [r.request_id for r, _ in candidates]
        alphas = [self.tracker.alpha(r.request_id, self._method_of(r)) for r, _ in candidates]
        num_drafting = max(1, sum(1 for cap in caps if cap > 0))
        cost = self.draft_forward_seconds

        def draft_seconds(num_draft_tokens: int) -> float:
            # Drafts spread over the batch: about total / batch sequential draft forwards.
            return cost * math.ceil(num_draft_tokens / num_drafting)

        allocation = self.hysteresis.allocate(
            ids, alphas, caps, base_tokens, context, self.step_model, draft_seconds,
            reasons, max_num_draft_tokens=budget,
        )  # fmt: skip
        final = [
            "goodput" if k > 0 else (reasons[i] or allocation.reasons[i])
            for i, k in enumerate(allocation.num_draft_tokens)
        ]
        return list(allocation.num_draft_tokens), final

    def _record(self, ks: list[int], reasons: list[str]) -> None:
        stats = self.stats
        stats.num_requests_decoding = len(ks)
        stats.num_requests_speculating = sum(1 for k in ks if k > 0)
        for k, reason in zip(ks, reasons, strict=True):
            stats.record(k, "speculate" if k > 0 else "skip", reason)

    def _method_of(self, request: Request) -> str:
        if request.prediction_token_ids:
            return "prediction"
        return self._method.get(request.request_id) or self.methods[0]

    # ------------------------------------------------------------------------ online learning

    def observe_step(self, num_tokens: int, context: int, seconds: float) -> None:
        self.step_model.observe(num_tokens, context, seconds)

    def observe_draft_time(self, seconds: float, num_forwards: int) -> None:
        if num_forwards > 0:
            per_forward = seconds / num_forwards
            self.draft_forward_seconds += _DRAFT_COST_RATE * (
                per_forward - self.draft_forward_seconds
            )

    def observe_verify(
        self, request: Request, source: str, num_draft_tokens: int, num_accepted: int
    ) -> None:
        self._method[request.request_id] = source
        self.tracker.observe(request.request_id, source, num_draft_tokens, num_accepted)

    def forget(self, request: Request) -> None:
        self._method.pop(request.request_id, None)
        self.tracker.forget(request.request_id)
        self.hysteresis.forget(request.request_id)
