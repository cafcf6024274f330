"""Token-budget continuous batching without prefill or decode phases.

Each step assigns `{request: num_tokens}` within `max_num_batched_tokens` and `max_num_seqs`:
running requests first (in arrival order), then waiting ones FCFS. A prompt longer than the
budget is computed in chunks across steps; a prefix-cache hit skips the tokens already cached.
When KV blocks run out the most recently admitted running request is preempted: its blocks are
freed and it goes back to the front of the queue to be recomputed later (its cached prefix
usually survives). The pool always holds one max-length request, so this never deadlocks.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Protocol

from engine.core.chunks import attention_reads
from engine.core.drafts import DraftOffer
from engine.core.request import Request, RequestStatus
from engine.core.schedule import Candidate, ScheduledRequest, SchedulerOutput, StepShape
from engine.core.stats import Decision
from engine.scheduling.block_manager import BlockManager

logger = logging.getLogger(__name__)


class DraftPolicy(Protocol):
    """Decides each decoding request's draft tokens (engine/policy/policy.py)."""

    def decide(self, candidates: Sequence[Candidate], shape: StepShape) -> list[Decision]: ...


class Scheduler:
    """Owns the waiting queue, the running list and the block manager."""

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        policy: DraftPolicy | None = None,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.policy = policy
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions_total = 0
        # Prefix-cache lookups at admission, in tokens (queried and found cached).
        self.num_prefix_cache_queries = 0
        self.num_prefix_cache_hits = 0

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def schedule(self, offers: Mapping[str, DraftOffer] | None = None) -> SchedulerOutput:
        """The step: running requests first, then drafts for those with an offer (the policy's
        k, within the budget left after what waiting requests need), then admissions."""
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        num_preempted = 0

        kept: list[tuple[Request, int]] = []
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if request.num_in_flight and _ends_in_flight(request, self.max_model_len):
                i += 1  # its last token is on the device: it stops once that lands
                continue
            num_new = min(
                request.num_tokens + request.num_in_flight - request.num_computed_tokens, budget
            )
            is_kept, num_victims = self._allocate_or_preempt(request, num_new)
            num_preempted += num_victims
            if not is_kept:
                break  # the request preempted itself: nothing after it is left either
            kept.append((request, num_new))
            budget -= num_new
            i += 1
        grants, decisions = self._grant_drafts(
            kept, offers or {}, budget - self._reserved_for_waiting(budget)
        )
        for request, num_new in kept:
            k = grants.get(request.request_id, 0)
            offer = (offers or {}).get(request.request_id)
            scheduled.append(ScheduledRequest(request, num_new, k, offer))
            budget -= k

        # Admitting new work right after preempting would only thrash the cache.
        while self.waiting and not num_preempted and budget > 0:
            if len(self.running) >= self.max_num_seqs:
                break
            request = self.waiting[0]
            if request.num_in_flight:  # preempted with a token on the device: once it lands
                break
            cached_blocks, num_cached = self.block_manager.get_computed_blocks(
                request.all_token_ids
            )
            num_new = min(request.num_tokens - num_cached, budget)
            if not self.block_manager.allocate_slots(
                request.request_id, num_cached + num_new, cached_blocks
            ):
                break
            self.waiting.popleft()
            self.num_prefix_cache_queries += request.num_tokens
            self.num_prefix_cache_hits += num_cached
            request.num_computed_tokens = num_cached
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
        return SchedulerOutput(tuple(scheduled), tuple(decisions), num_preempted)

    def _reserved_for_waiting(self, budget: int) -> int:
        """Budget kept for admitting waiting requests: new work comes before drafts (a draft
        token that displaces a prompt token only trades useful work for speculative work)."""
        if len(self.running) >= self.max_num_seqs:
            return 0
        wanted = 0
        for request in self.waiting:
            wanted += request.num_tokens - request.num_computed_tokens
            if wanted >= budget:
                return budget
        return wanted

    def _grant_drafts(
        self, kept: list[tuple[Request, int]], offers: Mapping[str, DraftOffer], budget: int
    ) -> tuple[dict[str, int], list[Decision]]:
        """Draft tokens per kept decoding request with an offer: the policy's decision within the
        budget, the context and max_tokens (a step emits at most drafts + 1 tokens) and what the
        offer can fill; then slots for them from the free blocks (speculation never preempts
        anyone). A grant the pool cannot hold becomes k = 0 before the decision is final."""
        if self.policy is None:
            return {}, []
        candidates = []
        for request, num_new in kept:
            offer = offers.get(request.request_id)
            if offer is None or num_new != 1:
                continue
            room = min(
                self.max_model_len - request.num_tokens,
                request.max_tokens - request.num_output_tokens - 1,
                offer.max_tokens,
            )
            if room > 0:
                candidates.append(Candidate(request, room, offer.source, offer.num_catch_up))
        if not candidates:
            return {}, []
        shape = StepShape(
            base_tokens=sum(num_new for _, num_new in kept),
            base_rows=sum(r.num_computed_tokens + n == r.num_tokens for r, n in kept),
            context=sum(attention_reads(r.num_computed_tokens, n) for r, n in kept),
            budget=max(budget, 0),
            num_running=len(self.running),
            # A draft token reads its sequence's positions: about a candidate's length.
            reads_per_draft=sum(c.request.num_tokens for c in candidates) / len(candidates),
        )
        decisions = self.policy.decide(candidates, shape)
        grants = {}
        for i, (c, d) in enumerate(zip(candidates, decisions, strict=True)):
            target = c.request.num_computed_tokens + 1 + d.num_draft_tokens
            if d.num_draft_tokens and not self.block_manager.allocate_slots(
                c.request.request_id, target
            ):
                decisions[i] = replace(
                    d, num_draft_tokens=0, reason="kv_cache_full", num_catch_up=0
                )
            elif d.num_draft_tokens:
                grants[c.request.request_id] = d.num_draft_tokens
        return grants, decisions

    def _allocate_or_preempt(self, request: Request, num_new: int) -> tuple[bool, int]:
        """Reserve slots for num_new more tokens, preempting from the back of the running list.
        Returns (whether the request itself is still running, number of requests preempted)."""
        num_victims = 0
        target = request.num_computed_tokens + num_new
        while not self.block_manager.allocate_slots(request.request_id, target):
            victim = self.running.pop()
            self._preempt(victim)
            num_victims += 1
            if victim is request:
                return False, num_victims
        return True, num_victims

    def _preempt(self, request: Request) -> None:
        self.block_manager.free(request.request_id)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.num_preemptions_total += 1
        self.waiting.appendleft(request)
        logger.debug("preempted %s", request.request_id)

    def update(self, request: Request, num_computed_tokens: int) -> None:
        """Record how many tokens now have valid KV (after a verify step: the accepted prefix,
        the rejected draft positions rolled back), offer the full blocks among them to the prefix
        cache, and free blocks that only held rejected positions."""
        request.num_computed_tokens = num_computed_tokens
        if request.is_finished:
            return
        self.block_manager.cache_blocks(
            request.request_id, request.all_token_ids, num_computed_tokens
        )
        self.block_manager.trim(request.request_id, request.num_tokens)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """End a request (stop, length or abort) and free its blocks, wherever it is."""
        assert status.is_finished
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.WAITING:
            self.waiting.remove(request)
        request.status = status
        self.block_manager.free(request.request_id)


def _ends_in_flight(request: Request, max_model_len: int) -> bool:
    """Whether the token a request has in flight is its last (max_tokens or the context)."""
    num_tokens = request.num_tokens + request.num_in_flight
    return (
        request.num_output_tokens + request.num_in_flight >= request.max_tokens
        or num_tokens >= max_model_len
    )
