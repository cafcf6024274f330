"""A smaller model with the target's tokenizer drafts for it (a member of the model drafters'
family: engine/drafters/drafting_loop.py holds the drafting loop it shares).

The draft model has its own runner (its own weights and KV tensors) but indexes its KV with the
SAME block tables as the target, so it needs no memory management of its own. In a step where
a request drafts:

1. One batched forward over the drafting requests: for each, every token the draft has not seen
   yet (its whole prompt the first time; after that what the target accepted since the last
   drafts plus the recovered or bonus token), with logits for the last one: q_1 -> d_1.
2. k - 1 more single-token forwards, batched across the drafting requests, for d_2 .. d_k.

On CUDA (`draft_follows_prefill`) the draft model reads each prompt chunk in the step the
target reads it (a forward of its own, no logits), so a request starts decoding with its draft
current and its first draft is a graph-shaped forward, not a catch-up over its whole prompt.
Otherwise the draft is lazy: a request the policy does not let speculate costs the draft model
nothing (the CPU's choice, where a draft prefill of every prompt would add to its first token),
and when speculation resumes its first forward catches up on everything it missed, so its KV is
exact again and acceptance does not collapse. The policy bounds that catch-up per step (engine/
speculation/costs.py): a request further behind gets chunks of catch-up over several steps
(`catch_up`, computed in the same first forward, no logits) and drafts once it is current, so a
long context never stalls the batch for the draft model's whole read of it; the proposer itself
holds every forward to MAX_CATCH_UP_CHUNK tokens of catch-up per request. The draft's KV does not follow the target's prefix
cache: a request starts with no draft KV (a cached block may never have had its draft KV written)
and after a preemption it starts over. No feedback is needed after verification: the next step
compares the request's tokens with the drafts it fed and keeps the KV of the accepted ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.core.chunks import SeqChunk
from engine.core.drafts import MAX_CATCH_UP_CHUNK
from engine.core.request import Request
from engine.core.stats import DraftTiming
from engine.drafters.drafting_loop import Drafted, ModelDrafter
from engine.execution.runner import ModelRunner
from engine.sampling.sampler import Sampler
from engine.scheduling.block_manager import BlockManager

__all__ = ["DraftModelProposer", "DraftTiming"]


@dataclass
class _DraftState:
    num_computed: int = 0  # leading tokens of request.all_token_ids with valid draft KV
    fed_at: int = 0  # request.num_tokens when the last drafts were fed
    fed: tuple[int, ...] = ()  # drafts fed as inputs (their KV was written at fed_at + j)
    num_preemptions: int = 0  # the request's count when this state was made


class DraftModelProposer(ModelDrafter):
    """Drafts with a smaller model sharing the target's block tables."""

    name = "draft_model"

    def __init__(
        self,
        runner: ModelRunner,
        sampler: Sampler,
        block_manager: BlockManager,
        min_confidence: float = 0.0,
        vocab_size: int | None = None,
        follows_prefill: bool = False,
    ) -> None:
        # The draft's own vocabulary may be padded to another size than the target's (see
        # ModelDrafter._sample).
        super().__init__(
            runner, sampler, min_confidence, vocab_size or runner.model_config.vocab_size
        )
        self.block_manager = block_manager
        self._states: dict[str, _DraftState] = {}
        self._scheduled: Sequence[tuple[Request, int]] = ()
        self._catch_up: Sequence[tuple[Request, int]] = ()
        self.follows_prefill = follows_prefill
        self._follow: Sequence[tuple[Request, int]] = ()

    def prepare(self, scheduled: Sequence[tuple[Request, int]]) -> None:
        self._scheduled = scheduled
        self._catch_up = ()

    def catch_up(self, requests: Sequence[tuple[Request, int]]) -> None:
        """This step's catch-up without drafts: (request, tokens) the next `propose` computes
        the draft KV of, from where the draft model stopped, in its first forward."""
        self._catch_up = requests

    def follow_prefill(self, scheduled: Sequence[tuple[Request, int]]) -> bool:
        """Of this step's chunks, the prompt chunks the draft model reads in its first forward
        (no logits): those that start where its KV of the request ends (not past a prefix-cache
        hit it never read, nor with fed drafts to settle). Nothing is looked at unless the draft
        model follows prefill (the CPU's step pays nothing for it)."""
        follow = []
        if self.follows_prefill:
            for request, n in scheduled:
                start = request.num_computed_tokens
                if n <= 0 or start + n > request.num_prompt_tokens:
                    continue
                state = self._sync(request)
                if state.num_computed == start and not state.fed:
                    follow.append((request, n))
        self._follow = follow
        return bool(follow)

    def free(self, request: Request) -> None:
        self._states.pop(request.request_id, None)

    def _sync(self, request: Request) -> _DraftState:
        """Bring the state up to date: keep the KV of fed drafts the target accepted, and never
        trust more than the target has computed; a preempted request starts over."""
        state = self._states.get(request.request_id)
        if state is None or state.num_preemptions != request.num_preemptions:
            state = _DraftState(num_preemptions=request.num_preemptions)
            self._states[request.request_id] = state
        if state.fed:
            tokens, kept = request.all_token_ids, 0
            while (
                kept < len(state.fed)
                and state.fed_at + kept < len(tokens)
                and tokens[state.fed_at + kept] == state.fed[kept]
            ):
                kept += 1
            state.num_computed = max(state.num_computed, state.fed_at + kept)
            state.fed = ()
        state.num_computed = min(state.num_computed, request.num_computed_tokens)
        return state

    def _first(
        self, requests: Sequence[Request], max_lengths: Sequence[int]
    ) -> tuple[list[tuple[Request, int]], torch.Tensor | None, int]:
        """One forward: for each drafting request every token the draft has not seen (with
        logits for the last), and the policy's catch-up chunks (no logits)."""
        num_new = {r.request_id: n for r, n in self._scheduled}
        chunks, drafting = [], []
        for request, k in zip(requests, max_lengths, strict=True):
            if k <= 0:
                continue
            state = self._sync(request)
            end = request.num_computed_tokens + num_new[request.request_id]  # known this step
            if end - 1 - state.num_computed > MAX_CATCH_UP_CHUNK:
                # Never one forward over an unbounded context (the policy does not grant this).
                self._catch_up = (*self._catch_up, (request, MAX_CATCH_UP_CHUNK))
                continue
            table = self.block_manager.get_block_table(request.request_id)
            tokens = self._inputs(request.all_token_ids[state.num_computed : end])
            chunks.append(SeqChunk(tokens, state.num_computed, table, 1))
            state.num_computed = end
            drafting.append((request, k))
        num_catch_up = sum(len(c.token_ids) - 1 for c in chunks)
        for request, num_tokens in self._catch_up:
            state = self._sync(request)
            # Only tokens the target has computed: their blocks are in the table.
            end = min(state.num_computed + num_tokens, request.num_computed_tokens)
            if end > state.num_computed:
                table = self.block_manager.get_block_table(request.request_id)
                tokens = self._inputs(request.all_token_ids[state.num_computed : end])
                chunks.append(SeqChunk(tokens, state.num_computed, table, 0))
                num_catch_up += end - state.num_computed
                state.num_computed = end
        self._catch_up = ()
        num_catch_up += self._read_prompts()
        if not chunks:
            return drafting, None, 0
        # Rows of the drafting requests, in their order (None when only catching up).
        return drafting, self.runner.forward(chunks), num_catch_up

    def _read_prompts(self) -> int:
        """The followed prompt chunks (`follow_prefill`) in a forward of their own, so the
        drafting rows' forward keeps a graph's shape -> the tokens read."""
        chunks = []
        for request, n in self._follow:
            state = self._sync(request)
            start = request.num_computed_tokens
            if state.num_computed == start:
                table = self.block_manager.get_block_table(request.request_id)
                tokens = self._inputs(request.all_token_ids[start : start + n])
                chunks.append(SeqChunk(tokens, start, table, 0))
                state.num_computed = start + n
        self._follow = ()
        if chunks:
            self.runner.forward(chunks)
        return sum(len(c.token_ids) for c in chunks)

    def _next(self, active: list[tuple[Request, int]], drafted: Drafted) -> torch.Tensor:
        logits = self.runner.forward([self._feed(r, drafted[r.request_id][0]) for r, _ in active])
        assert logits is not None
        return logits

    def _inputs(self, token_ids: list[int]) -> list[int]:
        """The request's tokens as the draft can embed them: an id past a narrower draft
        vocabulary (a padding id of the target's table, never made by the shared tokenizer)
        goes in as 0. It can only cost acceptance; the target verifies every draft."""
        limit = self.runner.model_config.vocab_size
        if self.vocab_size <= limit:
            return token_ids
        return [t if t < limit else 0 for t in token_ids]

    def num_behind(self, request: Request) -> int:
        """Tokens the draft model must catch up on before drafting for the request (its whole
        sequence the first time, what it missed while paused after that)."""
        state = self._states.get(request.request_id)
        if state is None or state.num_preemptions != request.num_preemptions:
            return request.num_computed_tokens
        return max(0, request.num_computed_tokens - state.num_computed - len(state.fed))

    def _feed(self, request: Request, ids: list[int]) -> SeqChunk:
        """Feed the latest draft token back in to get the next distribution."""
        state = self._states[request.request_id]
        position = request.num_tokens + len(ids) - 1
        state.fed_at, state.fed = request.num_tokens, tuple(ids)
        table = self.block_manager.get_block_table(request.request_id)
        return SeqChunk([ids[-1]], position, table, 1)
