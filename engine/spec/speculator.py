"""The speculator: builds the proposer chain from the config and drafts once per step.

Requests that carry a prediction (OpenAI Predicted Outputs) draft from it first; the rest go
through the configured chain in order ("ngram+draft_model": n-gram first, the draft model for
the requests n-gram found nothing for). The policy (engine/spec/planner.py) grants each
decoding request its k per step; a lookup proposer's draft is found while planning, so the
policy knows which requests would cost draft-model forwards. A draft model is lazy: it runs only
for the requests that draft with it, catching up on what it missed in its first forward.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from engine.device_monitor import make_monitor
from engine.request import Request
from engine.runner import SeqChunk
from engine.scheduler import ScheduledRequest
from engine.spec.calibration import load_or_calibrate, time_forward
from engine.spec.config import SpeculativeConfig
from engine.spec.planner import Candidate, DraftPlanner
from engine.spec.policy import StepTimeModel
from engine.spec.proposer import Draft, LookupProposer, Proposer, make_proposer
from engine.spec.stats import PolicyStats, SpecStats

# Draft length for predicted outputs when no speculative config sets one: a prediction is
# usually long and right, and verifying a token costs nothing while decode is memory-bound.
DEFAULT_PREDICTION_TOKENS = 8


@dataclass(frozen=True)
class ProposerContext:
    """What a proposer factory may need from the engine (a draft model needs all of it)."""

    engine: Any  # the LLMEngine being built: config, model_config, block_manager, max_model_len


class Speculator:
    """Runs the proposers each step; owns the speculation counters."""

    def __init__(self, config: SpeculativeConfig | None, context: ProposerContext) -> None:
        self.config = config
        self.chain: list[Proposer] = [
            make_proposer(name, spec=config, context=context)
            for name in (config.methods if config else ())
        ]
        self.prediction = make_proposer("prediction", spec=config, context=context)
        self.num_tokens = config.num_speculative_tokens if config else DEFAULT_PREDICTION_TOKENS
        self.stats = SpecStats()
        self.planner = _make_planner(config, context, self.num_tokens, self.chain)
        self._shadows: dict[str, tuple[int, Draft]] = {}  # request id -> (position, draft)
        self._lookups: dict[str, Draft] = {}  # lookup drafts found while planning this step

    @property
    def policy_stats(self) -> PolicyStats:
        return self.planner.stats

    def plan(
        self,
        candidates: Sequence[tuple[Request, int]],
        base_tokens: int,
        context: int,
        budget: int,
        num_running: int,
    ) -> list[int]:
        """Draft tokens per decoding request (request, room) this step: each request's source
        is found first — its prediction, else the chain in order, where a lookup proposer
        counts only if it has a draft now (and bounds the room by its length) — then the
        planner decides (DraftPlanner.plan). Requests nothing can draft for get 0 and no
        decision."""
        self._lookups.clear()
        found, where = [], []
        for i, (request, room) in enumerate(candidates):
            source, room, num_catch_up = self._source(request, room)
            if source is not None:
                found.append(Candidate(request, room, source, num_catch_up))
                where.append(i)
        ks = [0] * len(candidates)
        chosen = self.planner.plan(found, base_tokens, context, budget, num_running)
        for i, k in zip(where, chosen, strict=True):
            ks[i] = k
        return ks

    def _source(self, request: Request, room: int) -> tuple[str | None, int, int]:
        """(source, room, tokens to catch up on) for a request; source None: nothing drafts."""
        if request.prediction_token_ids:
            return "prediction", room, 0
        for proposer in self.chain:
            if not isinstance(proposer, LookupProposer):
                behind = getattr(proposer, "num_behind", None)
                return proposer.name, room, behind(request) if behind else 0
            draft = proposer.propose([request], [room])[0]
            if draft is not None:
                self._lookups[request.request_id] = draft
                return proposer.name, min(room, len(draft.token_ids)), 0
        return None, room, 0

    def propose(self, scheduled: Sequence[ScheduledRequest]) -> dict[str, Draft]:
        start = time.perf_counter()
        pairs = [(s.request, s.num_new_tokens) for s in scheduled]
        for proposer in (self.prediction, *self.chain):
            proposer.prepare(pairs)
        pending = [(s.request, s.num_draft_tokens) for s in scheduled if s.num_draft_tokens > 0]
        drafts: dict[str, Draft] = {}
        predicted = [(r, k) for r, k in pending if r.prediction_token_ids]
        self._ask(self.prediction, predicted, drafts)
        pending = [(r, k) for r, k in pending if r.request_id not in drafts]
        # Lookup drafts were already found while planning (same tokens, same index): reuse them,
        # cut to the grant, instead of looking up twice; the model proposers draft the rest.
        for request, k in pending:
            draft = self._lookups.get(request.request_id)
            if draft is not None:
                drafts[request.request_id] = replace(draft, token_ids=draft.token_ids[:k])
        pending = [(r, k) for r, k in pending if r.request_id not in drafts]
        for proposer in self.chain:
            if not pending:
                break
            if isinstance(proposer, LookupProposer):
                continue  # found nothing while planning, so nothing now
            self._ask(proposer, pending, drafts)
            pending = [(r, k) for r, k in pending if r.request_id not in drafts]
        if self.planner.mode == "auto":
            self._shadow_drafts(scheduled)
        self.stats.draft_time += time.perf_counter() - start
        return drafts

    def _shadow_drafts(self, scheduled: Sequence[ScheduledRequest]) -> None:
        """A decoding request the policy kept from speculating keeps the lookup draft found
        while planning (free to compute, never verified) as a shadow. Its next token tells
        whether the draft's first token would have been accepted — with one-hot drafts the
        verifier accepts exactly when the sampled token matches — so its acceptance estimate
        keeps learning while it is paused, and a request whose text turns predictable is
        switched back on."""
        self._shadows.clear()
        for s in scheduled:
            draft = self._lookups.get(s.request.request_id)
            if draft is not None and not s.num_draft_tokens:
                self._shadows[s.request.request_id] = (s.request.num_tokens, draft)

    def observe_plain(self, request: Request) -> None:
        """A step without a draft for the request: settle its shadow draft, if any."""
        shadow = self._shadows.pop(request.request_id, None)
        if shadow is None:
            return
        position, draft = shadow
        if position < request.num_tokens:
            is_accepted = request.all_token_ids[position] == draft.token_ids[0]
            self.planner.observe_verify(request, draft.source, 1, int(is_accepted))

    @staticmethod
    def _ask(
        proposer: Proposer, pending: list[tuple[Request, int]], drafts: dict[str, Draft]
    ) -> list[Draft]:
        results = proposer.propose([r for r, _ in pending], [k for _, k in pending])
        found = []
        for (request, k), draft in zip(pending, results, strict=True):
            if draft is not None:
                assert len(draft.token_ids) <= k, f"{proposer.name} drafted past its grant"
                drafts[request.request_id] = draft
                found.append(draft)
        return found

    def observe_step(self, chunks: Sequence[SeqChunk], seconds: float) -> None:
        """One measured target forward (and verification) over `chunks`, and the device time of
        this step's draft-model forwards. Called once the step has synchronised the device, so
        every timing here is work done, not kernels launched."""
        num_tokens = sum(len(c.token_ids) for c in chunks)
        context = sum(c.start + len(c.token_ids) for c in chunks)
        self.planner.observe_step(num_tokens, context, seconds)
        for proposer in self.chain:
            take_timing = getattr(proposer, "take_timing", None)
            timing = take_timing() if take_timing is not None else None
            if timing is not None:
                self.planner.observe_draft_time(timing)

    def observe_verify(self, request: Request, draft: Draft, num_accepted: int) -> None:
        """A verified draft: feeds the request's acceptance estimate."""
        self.planner.observe_verify(request, draft.source, len(draft.token_ids), num_accepted)

    def free(self, request: Request) -> None:
        for proposer in (self.prediction, *self.chain):
            proposer.free(request)
        self.planner.forget(request)
        self._shadows.pop(request.request_id, None)


def _make_planner(
    config: SpeculativeConfig | None,
    context: ProposerContext,
    num_tokens: int,
    chain: Sequence[Proposer],
) -> DraftPlanner:
    """The planner for the config. "auto" with a proposer chain calibrates the step-time model
    (cached) and times one draft-model forward (the draft cost's starting point, refined online);
    without a config only predictions draft, and a flat model lets them draft freely."""
    engine = context.engine
    mode = config.mode if config else "auto"
    methods = config.methods if config else ()
    draft_seconds = catch_up_per_token = 0.0
    if mode == "auto" and methods:
        step_model = load_or_calibrate(
            engine.runner,
            engine.block_manager,
            engine.model_config.path,
            engine.config.max_num_batched_tokens,
            engine.max_model_len,
        )
        draft_runner = next(
            (getattr(p, "runner", None) for p in chain if p.name == "draft_model"), None
        )
        if draft_runner is not None:
            time_forward(draft_runner, engine.block_manager, 1, 0, repeats=1)  # warm-up
            draft_seconds = time_forward(draft_runner, engine.block_manager, 1, 0, repeats=2)
            n = min(64, engine.max_model_len)
            catch_up = time_forward(draft_runner, engine.block_manager, n, 0, repeats=1)
            catch_up_per_token = max(0.0, catch_up - draft_seconds) / max(1, n - 1)
    else:
        step_model = StepTimeModel([1], [1.0], rate=0.0)
    return DraftPlanner(
        mode,
        num_tokens,
        methods,
        step_model,
        make_monitor(engine.runner.device.torch, step_model),
        config.spec_disable_batch_size if config else None,
        config.spec_disable_utilization if config else None,
        draft_seconds,
        catch_up_per_token,
    )
