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

In mode off `offer` looks nothing up and offers nothing: the scheduler asks no policy, and the
decoding requests a source could draft for are counted (reason mode_off), not decided one by one.
In auto a lookup whose drafts the policy left at 0 for low acceptance or a compute-bound batch is
paused: its next lookup (and shadow draft) waits 4, 8, 16, then LOOKUP_PAUSE_MAX (32) steps while
it keeps not paying, each pause ending at a multiple of its length so that paused requests wake
together and the steps between decide for none of them; granted, it looks up every step again,
and one the batch paused is due as soon as the running batch has shrunk by a quarter. At a large
batch, where nothing pays, a step then looks up and decides for about a thirtieth of its
requests (counted as paused); a paused request's n-gram index catches up at its next lookup. A
model drafter's offer is never paused (it costs nothing until granted): a paused request a chain
also drafts for with a model is offered the model.

The speculator knows the drafters only; the policy's mode reaches `offer` as an argument, its
decisions `after_schedule`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from engine.core.chunks import SeqChunk
from engine.core.drafts import Draft, DraftOffer
from engine.core.emitted import StepTokens
from engine.core.request import Request
from engine.core.schedule import ScheduledRequest, SchedulerOutput
from engine.core.stats import Decision, DraftTiming, VerifyResult
from engine.drafters.drafting_loop import ModelDrafter
from engine.drafters.proposer import Proposer
from engine.drafters.registry import DrafterContext, make_proposer
from engine.speculative_config import DEFAULT_PREDICTION_TOKENS

# The first and the longest pause between two lookups of a request whose lookup drafts do not
# pay (steps): each pause twice the last.
LOOKUP_PAUSE_MIN = 4
LOOKUP_PAUSE_MAX = 32
# The reasons of a lookup's k = 0 that pause it: its drafts would not pay, alone or in a batch
# this large (the latter until the batch shrinks), as opposed to a budget or a full pool.
PAUSE_REASONS = frozenset({"low_acceptance", "compute_bound"})


class Speculator:
    """The engine's draft sources: the configured chain, and every request's own (its grammar's
    forced text, its prediction); drafts once per step."""

    def __init__(
        self,
        chain: Sequence[Proposer],
        prediction: Proposer,
        grammar: Proposer,
        num_tokens: int,
    ) -> None:
        self.chain = list(chain)
        # The chain's model drafters, which every step calls for catch-up, extend and timing.
        self._model_drafters = [p for p in self.chain if isinstance(p, ModelDrafter)]
        self.prediction = prediction
        self.grammar = grammar
        self.num_tokens = num_tokens  # the most drafts a request verifies in one step
        self._step = 0  # offers made (engine steps)
        # request id -> (the step of its next lookup, its current pause, the running batch it
        # was paused in when the batch paused it, else 0): paused lookups only.
        self._paused: dict[str, tuple[int, int, int]] = {}
        self._num_running = 0  # the running batch of the last offer
        # The whole step's pause, like one request's (the step it is due, the pause, the batch):
        # while every decision leaves k = 0 for PAUSE_REASONS, an overlapped engine does not stop
        # overlapping to decide again (`is_due`) before that step.
        self._batch_pause: tuple[int, int, int] | None = None
        # The decoding requests of the last offer left without one, by reason (mode_off, paused).
        self.skipped: tuple[tuple[str, int], ...] = ()
        self._mode = "off"  # the mode of the last offer

    @property
    def reads_target_states(self) -> bool:
        """Whether a drafter of the chain reads the target's hidden states every step."""
        return any(p.reads_target_states for p in self._model_drafters)

    @classmethod
    def from_context(cls, context: DrafterContext) -> Speculator:
        """The chain context.spec names (none without a config), and the request sources."""
        spec = context.spec
        chain = [make_proposer(name, context) for name in (spec.methods if spec else ())]
        return cls(
            chain,
            make_proposer("prediction", context),
            make_proposer("grammar", context),
            spec.num_speculative_tokens if spec else DEFAULT_PREDICTION_TOKENS,
        )

    def offer(self, requests: Sequence[Request], mode: str) -> dict[str, DraftOffer]:
        """An offer per decoding request (one known token left to compute) that some source can
        draft for; requests nothing can draft for get none, and no decision. In mode off none at
        all (nothing will be granted): the requests a source could draft for are counted in
        `skipped` (mode_off), as are, in auto, the paused lookups (paused)."""
        self._step += 1
        self._mode = mode
        if mode == "off":
            self.skipped = self._count_off(requests)
            return {}
        step, paused, has_model = self._step, self._paused, bool(self._model_drafters)
        offers: dict[str, DraftOffer] = {}
        num_skipped = num_in_flight = 0
        # A lookup the batch's size paused (compute_bound) is due as soon as the batch has
        # shrunk by a quarter: the load that stopped it may have passed.
        shrunk = 4 * len(requests)
        self._num_running = len(requests)
        for request in requests:  # the step's hottest loop in auto: plain attributes only
            if request.num_in_flight:  # its last token is on the device: nothing to look up
                num_in_flight += 1
                continue
            if (
                len(request.all_token_ids) - request.num_computed_tokens != 1
                or not request.output_token_ids
            ):
                continue
            pause = paused.get(request.request_id)
            looks_up = not _is_paused(pause, step, shrunk) or request.grammar is not None
            if not looks_up:
                if has_model:
                    offers[request.request_id] = self._model_offer(request)
                else:
                    num_skipped += 1
                continue
            offer = self._offer(request)
            if offer is not None:
                offers[request.request_id] = offer
            elif pause is not None:  # a paused lookup's turn found nothing: its pause goes on
                paused[request.request_id] = (_wake(step, pause[1]), pause[1], pause[2])
        skipped = (("paused", num_skipped), ("in_flight", num_in_flight))
        self.skipped = tuple((reason, n) for reason, n in skipped if n)
        return offers

    def is_due(self, requests: Sequence[Request], mode: str) -> bool:
        """Whether a step now would offer drafts to one of the decoding requests (so an
        overlapped engine reads the step in flight first: drafts follow the last token). Never
        in mode off; in always for any request a source could draft for; in auto not while the
        last decided step left every request at 0 for PAUSE_REASONS (until that pause ends or
        the batch shrinks by a quarter), else for a model drafter, a lookup not paused, or a
        request's own source (its prediction)."""
        if mode == "off":
            return False
        step, shrunk = self._step + 1, 4 * len(requests)
        if mode == "auto" and _is_paused(self._batch_pause, step, shrunk):
            return False
        paused, chain = self._paused, bool(self.chain)
        model = bool(self._model_drafters)
        for request in requests:
            if (
                len(request.all_token_ids) + request.num_in_flight - request.num_computed_tokens
                != 1
            ):
                continue
            if request.grammar is not None or request.prediction_token_ids or model:
                return True
            if chain and (
                mode != "auto" or not _is_paused(paused.get(request.request_id), step, shrunk)
            ):
                return True
        return False

    def _count_off(self, requests: Sequence[Request]) -> tuple[tuple[str, int], ...]:
        """Mode off's skips: the decoding requests some source could draft for, with room for a
        draft within max_tokens (the ones a policy would have been asked about)."""
        any_source = bool(self.chain)
        num = 0
        for request in requests:
            if (
                len(request.all_token_ids) + request.num_in_flight - request.num_computed_tokens
                == 1
                and 0 < len(request.output_token_ids) < request.max_tokens - 1
                and (any_source or request.grammar is not None or request.prediction_token_ids)
            ):
                num += 1
        return (("mode_off", num),) if num else ()

    def after_schedule(self, decisions: Sequence[Decision], offers: dict[str, DraftOffer]) -> None:
        """Pause the lookups the policy left at 0 because they do not pay (PAUSE_REASONS), each
        pause twice the last up to LOOKUP_PAUSE_MAX steps; a granted lookup is no longer paused."""
        paused = self._paused
        if decisions:
            if all(not d.num_draft_tokens and d.reason in PAUSE_REASONS for d in decisions):
                last = (self._batch_pause or (0, LOOKUP_PAUSE_MIN // 2, 0))[1]
                pause = min(2 * last, LOOKUP_PAUSE_MAX)
                bound = any(d.reason == "compute_bound" for d in decisions)
                batch = self._num_running if bound else 0
                self._batch_pause = (_wake(self._step, pause), pause, batch)
            else:
                self._batch_pause = None
        for d in decisions:
            offer = offers.get(d.request_id)
            if offer is None or offer.draft is None or d.source == "grammar":
                continue
            if d.num_draft_tokens:
                paused.pop(d.request_id, None)
            elif d.reason in PAUSE_REASONS:
                last = paused.get(d.request_id, (0, LOOKUP_PAUSE_MIN // 2, 0))[1]
                pause = min(2 * last, LOOKUP_PAUSE_MAX)
                batch = self._num_running if d.reason == "compute_bound" else 0
                paused[d.request_id] = (_wake(self._step, pause), pause, batch)

    def _model_offer(self, request: Request) -> DraftOffer:
        """A paused lookup's offer: the chain's first model drafter (a paused request has no
        grammar, which always looks up, so only the chain's lookups are passed over)."""
        drafter = self._model_drafters[0]
        return DraftOffer(drafter.name, self.num_tokens, drafter.num_behind(request))

    def _offer(self, request: Request) -> DraftOffer | None:
        sources: list[Proposer] = [self.grammar] if request.grammar is not None else []
        if request.prediction_token_ids:
            sources.append(self.prediction)
        for proposer in (*sources, *self.chain):
            if isinstance(proposer, ModelDrafter):
                return DraftOffer(proposer.name, self.num_tokens, proposer.num_behind(request))
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
        for drafter in self._model_drafters:
            granted = by_model.get(drafter.name, [])
            behind = catch_up.get(drafter.name, [])
            if behind:
                drafter.catch_up(behind)
            # Mode off drafts nothing: no drafter reads prompts it would never draft after.
            following = self._mode != "off" and drafter.follow_prefill(pairs)
            if not granted and not behind and not following:
                continue
            found = drafter.propose(
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
        for proposer in self._model_drafters:
            proposer.after_step([s.request for s in schedule.scheduled], chunks, results)

    def take_draft_timing(self) -> DraftTiming | None:
        """The draft model's device time in this step, read once the step has synchronised."""
        for proposer in self._model_drafters:
            timing = proposer.take_timing()
            if timing is not None:
                return timing
        return None

    def free(self, request: Request) -> None:
        self._paused.pop(request.request_id, None)
        for proposer in (self.grammar, self.prediction, *self.chain):
            proposer.free(request)


def _is_paused(pause: tuple[int, int, int] | None, step: int, shrunk: int) -> bool:
    """Whether a pause (due step, length, batch) still holds at `step` with a running batch of
    shrunk / 4 (it ends at its step, or once the batch it held in has shrunk by a quarter)."""
    return pause is not None and pause[0] > step and shrunk >= 3 * pause[2]


def _wake(step: int, pause: int) -> int:
    """The step a lookup paused at `step` for `pause` steps is due: the next multiple of the
    pause, so the paused requests wake together and the steps between decide for none of them
    (the policy's cost is mostly per decision, not per candidate)."""
    return (step // pause + 1) * pause


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
