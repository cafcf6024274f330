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
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from engine.block_manager import BlockManager
from engine.request import Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step: known tokens to compute, and draft tokens it may verify
    (slots are reserved for both; a proposer may fill fewer drafts than granted)."""

    request: Request
    num_new_tokens: int
    num_draft_tokens: int = 0


@dataclass(frozen=True)
class SchedulerOutput:
    """What to compute this step, in batch order."""

    scheduled: tuple[ScheduledRequest, ...]
    num_preempted: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens + s.num_draft_tokens for s in self.scheduled)


class Scheduler:
    """Owns the waiting queue, the running list and the block manager."""

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        draft_length: Callable[[Request], int] | None = None,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        # How many draft tokens a decoding request may verify this step (the speculation policy).
        self.draft_length = draft_length
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

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        num_preempted = 0

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            num_drafts = self._num_drafts(request, num_new, budget)
            if num_drafts and not self.block_manager.allocate_slots(
                request.request_id, request.num_computed_tokens + num_new + num_drafts
            ):
                num_drafts = 0  # speculation never preempts anyone
            is_kept, num_victims = self._allocate_or_preempt(request, num_new + num_drafts)
            num_preempted += num_victims
            if not is_kept:
                break  # the request preempted itself: nothing after it is left either
            scheduled.append(ScheduledRequest(request, num_new, num_drafts))
            budget -= num_new + num_drafts
            i += 1

        # Admitting new work right after preempting would only thrash the cache.
        while self.waiting and not num_preempted and budget > 0:
            if len(self.running) >= self.max_num_seqs:
                break
            request = self.waiting[0]
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
        return SchedulerOutput(tuple(scheduled), num_preempted)

    def _num_drafts(self, request: Request, num_new: int, budget: int) -> int:
        """Draft tokens for a decoding request: what the policy grants, within the budget, the
        context and max_tokens (a step emits at most drafts + 1 tokens)."""
        is_decoding = num_new == 1 and request.num_output_tokens > 0
        if self.draft_length is None or not is_decoding:
            return 0
        return max(
            0,
            min(
                self.draft_length(request),
                budget - num_new,
                self.max_model_len - request.num_tokens,
                request.max_tokens - request.num_output_tokens - 1,
            ),
        )

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

    def update(
        self, request: Request, num_computed_tokens: int, num_cacheable_tokens: int | None = None
    ) -> None:
        """Record how many tokens now have valid KV (after a verify step: the accepted prefix,
        the rejected draft positions rolled back), offer the full blocks of the first
        num_cacheable_tokens (default: all computed) to the prefix cache, and free blocks that
        only held rejected positions."""
        request.num_computed_tokens = num_computed_tokens
        if request.is_finished:
            return
        num_cacheable = (
            num_computed_tokens if num_cacheable_tokens is None else num_cacheable_tokens
        )
        self.block_manager.cache_blocks(request.request_id, request.all_token_ids, num_cacheable)
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

    def finish_all(self, requests: Iterable[Request], status: RequestStatus) -> None:
        for request in list(requests):
            self.finish(request, status)
