"""The speculator: which source would draft for each request (offers), and the drafts (propose).

Requests under a grammar (structured outputs) draft the text it forces first, then requests that
carry a prediction (OpenAI Predicted Outputs) draft from it; the rest go through the configured
chain in order ("ngram+draft_model": n-gram first, the draft model for
the requests n-gram finds nothing for). Before the scheduler runs, `offer` names each decoding
request's source; a lookup source (n-gram, prediction) drafts right there, so its offer holds the
draft itself and its length bounds the grant. The scheduler asks the policy for each request's
k and hands back an immutable SchedulerOutput; `propose` cuts the lookup drafts to their grants
and runs the draft model for the rest. A draft model is lazy: it runs only for the requests that
draft with it, catching up on what it missed in its first forward. A lookup draft of a request
under a grammar is cut where the grammar forbids a token (the verifier would reject it there).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from engine.device_monitor import make_monitor
from engine.request import Request
from engine.speculation.calibration import load_or_calibrate, time_forward
from engine.speculation.config import MODEL_DRAFTERS, SpeculativeConfig
from engine.speculation.policy import SpeculationPolicy
from engine.speculation.proposer import Draft, LookupProposer, Proposer, make_proposer
from engine.speculation.stats import StepStats, VerifyResult
from engine.speculation.step_time import StepTimeModel
from engine.startup import startup_phase

if TYPE_CHECKING:
    from engine.runner import SeqChunk
    from engine.scheduler import ScheduledRequest, SchedulerOutput
    from engine.speculation.model_drafter import DraftTiming
    from engine.verifier import StepTokens

# Draft length for predicted outputs when no speculative config sets one: a prediction is
# usually long and right, and verifying a token costs nothing while decode is memory-bound.
DEFAULT_PREDICTION_TOKENS = 8

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProposerContext:
    """What a proposer factory may need from the engine (a draft model needs all of it)."""

    engine: Any  # the LLMEngine being built: config, model_config, block_manager, max_model_len


@dataclass(frozen=True)
class DraftOffer:
    """What one decoding request could draft this step: its source, the most tokens the source
    can fill, the tokens a draft model must first catch up on, and a lookup's draft."""

    source: str
    max_tokens: int
    num_catch_up: int = 0
    draft: Draft | None = None


class Speculator:
    """Builds the proposer chain and the policy from the config; drafts once per step."""

    def __init__(self, config: SpeculativeConfig | None, context: ProposerContext) -> None:
        self.config = config
        self.chain: list[Proposer] = [
            make_proposer(name, spec=config, context=context)
            for name in (config.methods if config else ())
        ]
        self.prediction = make_proposer("prediction", spec=config, context=context)
        self.grammar = make_proposer("grammar", spec=config, context=context)
        self.num_tokens = config.num_speculative_tokens if config else DEFAULT_PREDICTION_TOKENS
        self.policy = _make_policy(config, context, self.num_tokens, self.chain)

    def offer(self, requests: Sequence[Request]) -> dict[str, DraftOffer]:
        """An offer per decoding request (one known token left to compute) that some source can
        draft for; requests nothing can draft for get none, and no decision."""
        offers = {}
        for request in requests:
            if request.num_output_tokens and request.num_tokens - request.num_computed_tokens == 1:
                offer = self._offer(request)
                if offer is not None:
                    offers[request.request_id] = offer
        return offers

    def _offer(self, request: Request) -> DraftOffer | None:
        sources: list[Proposer] = [self.grammar] if request.grammar is not None else []
        if request.prediction_token_ids:
            sources.append(self.prediction)
        if self.policy.mode == "off" and (sources or self.chain):
            # Nothing will be granted: the decision (mode_off) needs no lookup's draft.
            return DraftOffer((*sources, *self.chain)[0].name, self.num_tokens)
        for proposer in (*sources, *self.chain):
            if not isinstance(proposer, LookupProposer):
                behind = getattr(proposer, "num_behind", None)
                return DraftOffer(proposer.name, self.num_tokens, behind(request) if behind else 0)
            draft = proposer.propose([request], [self.num_tokens])[0]
            if draft is not None and request.grammar is not None:
                draft = _within_grammar(request, draft)
            if draft is not None:
                return DraftOffer(proposer.name, len(draft.token_ids), draft=draft)
        return None

    def propose(self, schedule: SchedulerOutput) -> dict[str, Draft]:
        """The drafts for the granted requests: lookups cut to their grants, model drafts made
        now (a proposer may fill fewer tokens than granted, or none)."""
        pairs = [(s.request, s.num_new_tokens) for s in schedule.scheduled]
        for proposer in (self.grammar, self.prediction, *self.chain):
            proposer.prepare(pairs)
        drafts: dict[str, Draft] = {}
        by_model: dict[str, list[ScheduledRequest]] = {}
        for s in schedule.scheduled:
            if not s.num_draft_tokens or s.offer is None:
                continue
            if s.offer.draft is not None:
                tokens = s.offer.draft.token_ids[: s.num_draft_tokens]
                drafts[s.request.request_id] = replace(s.offer.draft, token_ids=tokens)
            else:
                by_model.setdefault(s.offer.source, []).append(s)
        # Requests a draft model catches up on without drafting (the policy's chunk of it).
        catch_up: dict[str, list[tuple[Request, int]]] = {}
        chunks = {d.request_id: d.num_catch_up for d in schedule.decisions if d.num_catch_up}
        for s in schedule.scheduled:
            n = chunks.get(s.request.request_id, 0)
            if n and not s.num_draft_tokens and s.offer is not None:
                catch_up.setdefault(s.offer.source, []).append((s.request, n))
        for proposer in self.chain:
            granted = by_model.get(proposer.name, [])
            behind = catch_up.get(proposer.name, [])
            if behind:
                proposer.catch_up(behind)  # type: ignore[attr-defined]  # a model proposer
            if not granted and not behind:
                continue
            found = proposer.propose(
                [s.request for s in granted], [s.num_draft_tokens for s in granted]
            )
            for s, draft in zip(granted, found, strict=True):
                if draft is not None:
                    assert len(draft.token_ids) <= s.num_draft_tokens, "drafted past its grant"
                    drafts[s.request.request_id] = draft
        return drafts

    def after_step(
        self, schedule: SchedulerOutput, chunks: Sequence[SeqChunk], results: Sequence[StepTokens]
    ) -> None:
        """Once the target has run and verified: a drafter that reads the target's hidden states
        (eagle3) extends its KV over what the step computed and kept."""
        for proposer in self.chain:
            after_step = getattr(proposer, "after_step", None)
            if after_step is not None:
                after_step([s.request for s in schedule.scheduled], chunks, results)

    def take_draft_timing(self) -> DraftTiming | None:
        """The draft model's device time in this step, read once the step has synchronised."""
        for proposer in self.chain:
            take_timing = getattr(proposer, "take_timing", None)
            timing = take_timing() if take_timing is not None else None
            if timing is not None:
                return timing
        return None

    def observe(self, stats: StepStats) -> None:
        self.policy.observe(stats)

    @property
    def mode(self) -> str:
        return self.policy.mode

    def set_mode(self, mode: str) -> None:
        self.policy.set_mode(mode)

    def free(self, request: Request) -> None:
        for proposer in (self.grammar, self.prediction, *self.chain):
            proposer.free(request)
        self.policy.forget(request.request_id)


def _within_grammar(request: Request, draft: Draft) -> Draft | None:
    """The draft cut before the first token the request's grammar forbids (None if the first)."""
    num_allowed = request.grammar.num_allowed(draft.token_ids)
    if num_allowed == len(draft.token_ids):
        return draft
    return replace(draft, token_ids=draft.token_ids[:num_allowed]) if num_allowed else None


def shadow_result(s: ScheduledRequest, first_token: int) -> VerifyResult | None:
    """A lookup draft the policy did not grant, checked against the token the step emitted (see
    VerifyResult): whether its first token would have been accepted."""
    if s.num_draft_tokens or s.offer is None or s.offer.draft is None:
        return None
    is_accepted = int(s.offer.draft.token_ids[0] == first_token)
    return VerifyResult(s.request.request_id, s.offer.source, 1, is_accepted, is_shadow=True)


def _make_policy(
    config: SpeculativeConfig | None,
    context: ProposerContext,
    num_tokens: int,
    chain: Sequence[Proposer],
) -> SpeculationPolicy:
    """The policy for the config. "auto" with a proposer chain calibrates the step-time model
    (cached) and times the draft model's forwards (starting points, refined online). Without a
    config only what a request brings drafts (its prediction, its grammar's forced text), and
    always: the client asked for it, and so the drafts do not depend on timings."""
    engine = context.engine
    mode = config.mode if config else "always"
    draft_seconds = catch_up_per_token = 0.0
    if mode == "auto" and chain:
        with startup_phase("calibration"):  # the step-time model, or its cached fit
            step_model = load_or_calibrate(
                engine.runner,
                engine.block_manager,
                engine.model_config.path,
                engine.config.max_num_batched_tokens,
                engine.max_model_len,
            )
        draft_runner = next(
            (getattr(p, "runner", None) for p in chain if p.name in MODEL_DRAFTERS), None
        )
        if draft_runner is not None:
            with startup_phase("draft timing"):
                time_forward(draft_runner, engine.block_manager, 1, 0, repeats=1)  # warm-up
                draft_seconds = time_forward(draft_runner, engine.block_manager, 1, 0, repeats=2)
                n = min(64, engine.max_model_len)
                catch_up = time_forward(draft_runner, engine.block_manager, n, 0, repeats=1)
                catch_up_per_token = max(0.0, catch_up - draft_seconds) / max(1, n - 1)
    else:
        step_model = StepTimeModel([1], [1.0], rate=0.0)
    is_calibrated = mode == "auto" and bool(chain)
    limit = config.spec_disable_utilization if config else None
    if limit is not None and not is_calibrated:
        # The device's load is judged against the calibrated knee; a placeholder model's knee of
        # 1 token would read every step as saturated and switch speculation off for good.
        logger.warning(
            "spec_disable_utilization %.2f is not applied: it needs mode auto's calibration "
            "(mode is %s)",
            limit,
            mode,
        )
    return SpeculationPolicy(
        mode,
        num_tokens,
        step_model,
        make_monitor(engine.runner.device.torch, step_model) if is_calibrated else None,
        config.spec_disable_batch_size if config else None,
        config.spec_disable_utilization if config else None,
        draft_seconds,
        catch_up_per_token,
        is_calibrated=is_calibrated,
    )
