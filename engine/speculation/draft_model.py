"""A smaller model with the target's tokenizer drafts for it.

The draft model has its own runner (its own weights and KV tensors) but indexes its KV with the
SAME block tables as the target, so it needs no memory management of its own. In a step where
a request drafts:

1. One batched forward over the drafting requests: for each, every token the draft has not seen
   yet (its whole prompt the first time; after that what the target accepted since the last
   drafts plus the recovered or bonus token), with logits for the last one: q_1 -> d_1.
2. k - 1 more single-token forwards, batched across the drafting requests, for d_2 .. d_k.

The draft is lazy: a request the policy does not let speculate costs the draft model nothing,
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
from typing import Any

import torch

from engine.block_manager import BlockManager
from engine.request import Request
from engine.runner import ModelRunner, SeqChunk
from engine.sampler import Sampler
from engine.speculation.costs import MAX_CATCH_UP_CHUNK
from engine.speculation.proposer import Draft
from engine.structured.masks import TokenMasks, mask_width, new_masks
from engine.verifier import DRAFT_STREAM, sampling_row


@dataclass(frozen=True)
class DraftTiming:
    """Seconds of the draft model's last propose: the first forward (catching up on
    num_catch_up tokens besides one per drafting request, num_drafting of them) and the
    num_more single-token forwards after it."""

    num_catch_up: int
    first_seconds: float
    num_more: int
    more_seconds: float
    num_drafting: int = 1


@dataclass
class _DraftState:
    num_computed: int = 0  # leading tokens of request.all_token_ids with valid draft KV
    fed_at: int = 0  # request.num_tokens when the last drafts were fed
    fed: tuple[int, ...] = ()  # drafts fed as inputs (their KV was written at fed_at + j)
    num_preemptions: int = 0  # the request's count when this state was made


class DraftModelProposer:
    """Drafts with a smaller model sharing the target's block tables."""

    name = "draft_model"

    def __init__(
        self,
        runner: ModelRunner,
        sampler: Sampler,
        block_manager: BlockManager,
        min_confidence: float = 0.0,
        vocab_size: int | None = None,
    ) -> None:
        self.runner = runner
        # The target's vocabulary: the width of the q rows the verifier compares with p (the
        # draft's own may be padded to another size; see _sample).
        self.vocab_size = vocab_size or runner.model_config.vocab_size
        self.min_confidence = min_confidence
        self.sampler = sampler
        self.block_manager = block_manager
        self._states: dict[str, _DraftState] = {}
        self._scheduled: Sequence[tuple[Request, int]] = ()
        self._catch_up: Sequence[tuple[Request, int]] = ()
        # Device marks of the last propose (num_catch_up, num_drafting, start, after the first
        # forward, num_more, end), read into a DraftTiming once the step has synchronised.
        self._marks: tuple[int, int, Any, Any, int, Any] | None = None

    def prepare(self, scheduled: Sequence[tuple[Request, int]]) -> None:
        self._scheduled = scheduled
        self._catch_up = ()

    def catch_up(self, requests: Sequence[tuple[Request, int]]) -> None:
        """This step's catch-up without drafts: (request, tokens) the next `propose` computes
        the draft KV of, from where the draft model stopped, in its first forward."""
        self._catch_up = requests

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

    @torch.inference_mode()
    def propose(
        self, requests: Sequence[Request], max_lengths: Sequence[int]
    ) -> list[Draft | None]:
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
        if not chunks:
            return [None] * len(requests)
        device = self.runner.device
        start = device.mark()
        logits = self.runner.forward(chunks)  # rows of the drafting requests, in their order
        first = device.mark()
        drafted: dict[str, tuple[list[int], list[torch.Tensor]]] = {
            r.request_id: ([], []) for r, _ in drafting
        }
        stopped: set[str] = set()
        num_more = 0
        for step in range(max((k for _, k in drafting), default=0)):
            # A request stops drafting at its grant, or once the draft is unsure of its token.
            active = [
                (r, k)
                for r, k in drafting
                if step < k
                and r.request_id not in stopped
                and len(drafted[r.request_id][0]) == step
            ]
            if not active:
                break
            if step > 0:
                num_more += 1
                logits = self.runner.forward(
                    [self._feed(r, drafted[r.request_id][0]) for r, _ in active]
                )
            assert logits is not None
            stopped.update(self._sample(logits, active, drafted))
        self._marks = (num_catch_up, len(drafting), start, first, num_more, device.mark())
        return [self._draft(r, drafted) for r in requests]

    def take_timing(self) -> DraftTiming | None:
        """The device time of the last propose, or None if it has been taken (or none ran).
        Call after the step's synchronisation: the marks are read, never waited on."""
        if self._marks is None:
            return None
        num_catch_up, num_drafting, start, first, num_more, end = self._marks
        self._marks = None
        elapsed = self.runner.device.elapsed
        return DraftTiming(
            num_catch_up, elapsed(start, first), num_more, elapsed(first, end), num_drafting
        )

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

    def _sample(
        self,
        logits: torch.Tensor,  # [num_active, vocab_size]
        active: list[tuple[Request, int]],
        drafted: dict[str, tuple[list[int], list[torch.Tensor]]],
    ) -> list[str]:
        """Sample each active request's next draft token; return the ids of requests that stop
        drafting here."""
        rows = []
        for request, _ in active:
            ids = drafted[request.request_id][0]
            # The row for the draft's next position, history extended by the drafts so far.
            rows.append(sampling_row(request, ids, logits.device, DRAFT_STREAM))
        masks = _grammar_masks(active, drafted, logits.shape[1])
        processed = self.sampler.process(logits, rows, masks)  # [num_active, draft_vocab]
        # Padding rows of a draft vocabulary wider than the target's are ids the target cannot
        # emit: never draft them (q is then exactly what the draft samples from).
        processed[:, self.vocab_size :] = float("-inf")
        token_ids = self.sampler.sample_processed(processed, rows).token_ids  # [num_active]
        probs = processed.softmax(dim=-1)  # [num_active, draft_vocab]
        if probs.shape[1] != self.vocab_size:  # q over the target's ids: 0 past the draft's
            probs = torch.nn.functional.pad(probs, (0, self.vocab_size - probs.shape[1]))
        # probs: [num_active, vocab_size]
        # Early exit: a token the draft itself gives little probability is likely rejected, and
        # every further draft forward would build on it. Stopping depends only on the draft's
        # own samples, so verification stays exact.
        confident = probs.gather(1, token_ids[:, None])[:, 0] >= self.min_confidence  # [num_active]
        # One device-to-host read for the whole draft step, ids and flags together: reading a
        # CUDA tensor on the host waits for the device, so a read per request would be a sync
        # per request per draft step.
        host_ids, host_confident = torch.stack([token_ids, confident.to(token_ids.dtype)]).tolist()
        for i, (request, _) in enumerate(active):
            ids, dists = drafted[request.request_id]
            ids.append(host_ids[i])
            if not request.params.is_greedy:
                dists.append(probs[i])
        return [r.request_id for i, (r, _) in enumerate(active) if not host_confident[i]]

    def _draft(
        self, request: Request, drafted: dict[str, tuple[list[int], list[torch.Tensor]]]
    ) -> Draft | None:
        if request.request_id not in drafted:
            return None
        ids, dists = drafted[request.request_id]
        if not ids:
            return None
        probs = torch.stack(dists) if dists else None  # [k, vocab_size]
        return Draft(tuple(ids), self.name, probs)


def _grammar_masks(
    active: list[tuple[Request, int]],
    drafted: dict[str, tuple[list[int], list[torch.Tensor]]],
    draft_vocab: int,
) -> TokenMasks | None:
    """Masks for the active requests under a grammar: each with its state after the tokens it
    drafted so far (rolled back after), so the draft proposes only what the grammar allows and q
    is what it samples from. Width of the draft's vocabulary: ids past the target's are banned."""
    row_ids = [i for i, (r, _) in enumerate(active) if r.grammar is not None]
    if not row_ids:
        return None
    vocab_size = active[row_ids[0]][0].grammar.vocab_size
    masks = new_masks(len(row_ids), vocab_size)  # [n, target words]
    for row, i in enumerate(row_ids):
        state, ids = active[i][0].grammar, drafted[active[i][0].request_id][0]
        num = 0  # every drafted id was sampled under its mask: all are taken
        while num < len(ids) and not state.is_terminated and state.accept(ids[num]):
            num += 1
        if num == len(ids) and not state.is_terminated:
            state.fill_mask(masks, row)
        state.rollback(num)
    width = mask_width(draft_vocab)
    if width != masks.shape[1]:
        wide = torch.zeros(len(row_ids), width, dtype=torch.int32, device="cpu")  # host, as masks
        n = min(width, masks.shape[1])
        wide[:, :n] = masks[:, :n]
        masks = wide
    return TokenMasks(row_ids, masks)
