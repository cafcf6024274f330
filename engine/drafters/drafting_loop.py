"""The family of model drafters: a network that drafts k tokens per request in k chained,
batched forwards, with its own KV under the target's block tables.

What every member shares lives here: the drafting loop (one first forward for all drafting
requests, then one single-token forward per further draft position, over the requests still
drafting), sampling each draft from the processed distribution q (the request's own sampling
options, penalties and grammar mask, so the verifier's min(1, p/q) test is exact), the early
exit on an unsure draft, and the device timing the policy learns from. What differs is each
member's own small part:

- `DraftModelProposer` (engine/drafters/draft_model.py): a smaller model with the target's
  tokenizer; its first forward catches up on the tokens it has not seen.
- `Eagle3Proposer` (engine/drafters/eagle3.py): an EAGLE-3 head reading the target's hidden
  states, its K/V kept current by an extend after every target step; its first forward is one
  token a drafting request, from the h it kept.

A member implements `_first` (the first forward: which requests draft, and their first logits)
and `_next` (one chained forward for the active requests, given their drafts so far), both with
logits over the target's vocabulary or a padded draft vocabulary past it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from engine.core.chunks import SeqChunk
from engine.core.drafts import Draft
from engine.core.request import Request
from engine.core.stats import DraftTiming
from engine.execution.runner import ModelRunner
from engine.sampling.rows import DRAFT_STREAM, sampling_row
from engine.sampling.sampler import Sampler
from engine.structured.masks import TokenMasks, mask_width, new_masks

# Drafts so far per drafting request: (token ids, their q rows [vocab_size] at temperature > 0).
Drafted = dict[str, tuple[list[int], list[torch.Tensor]]]


class ModelDrafter:
    """Base of the model drafters: the chained drafting loop, sampling and timing."""

    # Whether it reads the target's hidden states of every step (`after_step`): an engine with
    # such a drafter does not overlap steps (the next forward would overwrite them first).
    reads_target_states = False

    name: str

    def __init__(
        self,
        runner: ModelRunner,
        sampler: Sampler,
        min_confidence: float,
        vocab_size: int,
    ) -> None:
        self.runner = runner
        # The target's vocabulary: the width of the q rows the verifier compares with p.
        self.vocab_size = vocab_size
        self.min_confidence = min_confidence
        self.sampler = sampler
        # Device marks of the last propose (num_catch_up, num_drafting, start, after the first
        # forward, num_more, end), read into a DraftTiming once the step has synchronised.
        self._marks: tuple[int, int, Any, Any, int, Any] | None = None

    # ------------------------------------------------------------------ a member's own part

    def _first(
        self, requests: Sequence[Request], max_lengths: Sequence[int]
    ) -> tuple[list[tuple[Request, int]], torch.Tensor | None, int]:
        """The first forward: (the requests that draft, with their grants), logits for their
        first draft [num_drafting, width] (None if none), tokens computed besides."""
        raise NotImplementedError

    def _next(self, active: list[tuple[Request, int]], drafted: Drafted) -> torch.Tensor:
        """One chained forward: logits [len(active), width] for each active request's next
        draft, given the drafts it has so far."""
        raise NotImplementedError

    def num_behind(self, request: Request) -> int:
        """Tokens the drafter must catch up on before drafting for the request (0: current)."""
        return 0

    def catch_up(self, requests: Sequence[tuple[Request, int]]) -> None:
        """This step's catch-up without drafts, (request, tokens) pairs, computed in the next
        `propose`'s first forward; a drafter that is always current has none."""

    def follow_prefill(self, scheduled: Sequence[tuple[Request, int]]) -> bool:
        """Of this step's chunks, (request, tokens) pairs, the prompt chunks the next `propose`
        reads too, so the drafter is current when the request starts decoding; whether any is
        taken. A drafter that does not follow prefill takes none."""
        return False

    def after_step(
        self, requests: Sequence[Request], chunks: Sequence[SeqChunk], results: Sequence[object]
    ) -> None:
        """The target has run the step over `chunks` and verified it (`results`, the rows that
        sampled): a drafter that reads the target's hidden states catches up here."""

    # ------------------------------------------------------------------ shared

    @torch.inference_mode()
    def propose(
        self, requests: Sequence[Request], max_lengths: Sequence[int]
    ) -> list[Draft | None]:
        device = self.runner.device
        start = device.mark()
        drafting, logits, num_catch_up = self._first(requests, max_lengths)
        if logits is None and not num_catch_up:
            return [None] * len(requests)
        first = device.mark()
        drafted: Drafted = {r.request_id: ([], []) for r, _ in drafting}
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
                logits = self._next(active, drafted)
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

    def _sample(
        self,
        logits: torch.Tensor,  # [num_active, width]
        active: list[tuple[Request, int]],
        drafted: Drafted,
    ) -> list[str]:
        """Sample each active request's next draft token; return the ids of requests that stop
        drafting here."""
        rows = []
        for request, _ in active:
            ids = drafted[request.request_id][0]
            # The row for the draft's next position, history extended by the drafts so far.
            rows.append(sampling_row(request, ids, logits.device, DRAFT_STREAM))
        masks = _grammar_masks(active, drafted, logits.shape[1])
        processed = self.sampler.process(logits, rows, masks)  # [num_active, width]
        # Padding rows of a draft vocabulary wider than the target's are ids the target cannot
        # emit: never draft them (q is then exactly what the draft samples from).
        processed[:, self.vocab_size :] = float("-inf")
        # Only a grammar mask can leave a row with nothing (over a head's narrower vocabulary):
        # such a row drafts nothing, and stops. Without masks no row is checked.
        possible = None
        if masks is not None:
            possible = processed.amax(dim=-1) > float("-inf")  # [num_active]
            processed.masked_fill_(~possible[:, None], 0.0)
        token_ids = self.sampler.sample_processed(processed, rows).token_ids  # [num_active]
        probs = processed.softmax(dim=-1)  # [num_active, width]
        if probs.shape[1] != self.vocab_size:  # q over the target's ids: 0 past the draft's
            probs = torch.nn.functional.pad(probs, (0, self.vocab_size - probs.shape[1]))
        # probs: [num_active, vocab_size]
        # Early exit: a token the draft itself gives little probability is likely rejected, and
        # every further draft forward would build on it. Stopping depends only on the draft's
        # own samples, so verification stays exact.
        confident = probs.gather(1, token_ids[:, None])[:, 0] >= self.min_confidence
        # One device-to-host read for the whole draft step, ids and flags together: reading a
        # CUDA tensor on the host waits for the device, so a read per request would be a sync
        # per request per draft step.
        flags = [token_ids, confident.to(token_ids.dtype)]
        if possible is not None:
            flags.append(possible.to(token_ids.dtype))
        host_ids, host_confident, *rest = torch.stack(flags).tolist()
        host_possible = rest[0] if rest else [1] * len(active)
        for i, (request, _) in enumerate(active):
            if not host_possible[i]:
                continue
            ids, dists = drafted[request.request_id]
            ids.append(host_ids[i])
            if not request.params.is_greedy:
                dists.append(probs[i])
        return [
            r.request_id
            for i, (r, _) in enumerate(active)
            if not (host_confident[i] and host_possible[i])
        ]

    def _draft(self, request: Request, drafted: Drafted) -> Draft | None:
        if request.request_id not in drafted:
            return None
        ids, dists = drafted[request.request_id]
        if not ids:
            return None
        probs = torch.stack(dists) if dists else None  # [k, vocab_size]
        return Draft(tuple(ids), self.name, probs)


def _grammar_masks(
    active: list[tuple[Request, int]], drafted: Drafted, draft_vocab: int
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
