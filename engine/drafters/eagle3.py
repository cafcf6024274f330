"""An EAGLE-3 head drafts from the target's own hidden states (a member of the model drafters'
family: engine/drafters/drafting_loop.py holds the drafting loop it shares).

Head position t pairs the target's features at t (its residual stream entering the tapped
layers, combined by `fc`) with token t + 1 and predicts token t + 2. The head's KV lives in its
own one-layer cache under the target's block tables.

The head is kept current: right after every target step, once verification has said which
tokens stand, one batched head pass (the extend) writes the head's KV at every position the
target computed and kept that step, prompt chunks included, for every request that step ran,
finishing ones too (their blocks may serve a later request from the prefix cache). The extend
computes only what the KV needs (`fc` of the taps, the two norms, the K/V rows of the q/k/v
projection: about a seventh of the layer's products per token), since no position's output is
read then; each request keeps its last position's token and h. The target's features are used
in the step that made them and never stored across steps (one h per request is), so no memory
grows while the policy pauses drafting, and resuming never stalls. Drafting runs k single-token
head forwards per request, batched: the first at the last kept position from its kept h (it
rewrites that position's KV with the same values), each later one feeding back the head's own
pre-norm output as h; the KV they write past the last computed position is overwritten by the
next extend. So a step that does not draft pays the extend's K/V only, and the layer's full
forward is paid by the drafting steps, per drafted token.

A request whose prompt starts in the prefix cache starts its head state at the cached length:
those blocks' head KV was written by the extend of the request that computed them.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.core.chunks import SeqChunk
from engine.core.request import Request
from engine.drafters.drafting_loop import Drafted, ModelDrafter
from engine.execution.runner import ModelRunner
from engine.models.eagle3.head import Eagle3Head
from engine.models.llama import LlamaForCausalLM
from engine.sampling.sampler import Sampler
from engine.scheduling.block_manager import BlockManager


@dataclass
class _HeadState:
    num_computed: int = 0  # head positions [0, num_computed) hold KV made from target features
    # The head's inputs at position num_computed - 1 (the token after it, and h [H] from the
    # target's features there), for the first draft's forward; None until an extend sets them.
    last_token: int | None = None
    last_hidden: torch.Tensor | None = None
    num_preemptions: int = 0  # the request's count when this state was made


@dataclass(frozen=True)
class ExtendSpan:
    """Positions [start, start + len(token_ids)) of one request the target computed and kept in
    a step: their features are rows [row, row + len(token_ids)) of the step's taps, and
    token_ids are the tokens that follow each position (t + 1)."""

    request: Request
    start: int
    token_ids: Sequence[int]
    row: int


class Eagle3Proposer(ModelDrafter):
    """Drafts with an EAGLE-3 head (engine.models.eagle3.head.Eagle3Head) run by its own runner."""

    reads_target_states = True

    name = "eagle3"

    def __init__(
        self,
        runner: ModelRunner,  # the head's
        target: ModelRunner,
        sampler: Sampler,
        block_manager: BlockManager,
        min_confidence: float = 0.0,
    ) -> None:
        super().__init__(runner, sampler, min_confidence, target.model_config.vocab_size)
        assert isinstance(runner.model, Eagle3Head), "an EAGLE-3 head's runner"
        assert isinstance(target.model, LlamaForCausalLM), "a head taps a Llama-family target"
        self.head = runner.model
        self.target = target
        self.target_model = target.model
        self.block_manager = block_manager
        self._states: dict[str, _HeadState] = {}
        self._chain: dict[str, torch.Tensor] = {}  # request -> the last chained output [H]
        # Device marks and token count of the last extend (start, end, num_tokens).
        self.extend_marks: tuple[object, object, int] | None = None

    def after_step(
        self, requests: Sequence[Request], chunks: Sequence[SeqChunk], results: Sequence[object]
    ) -> None:
        """The step has run and verified: extend over what it computed and kept."""
        self.extend(extend_spans(list(zip(requests, chunks, strict=True)), results))

    def prepare(self, scheduled: Sequence[tuple[Request, int]]) -> None:
        """Nothing: the head was brought current by the last step's extend."""

    def free(self, request: Request) -> None:
        self._states.pop(request.request_id, None)

    def _state(self, request: Request) -> _HeadState:
        state = self._states.get(request.request_id)
        if state is None or state.num_preemptions != request.num_preemptions:
            state = _HeadState(num_preemptions=request.num_preemptions)
            self._states[request.request_id] = state
        return state

    # ------------------------------------------------------------------ the extend

    @torch.inference_mode()
    def extend(self, spans: Sequence[ExtendSpan]) -> None:
        """Write the head's KV at every span's positions from the target's taps of the step just
        run, and keep each request's last token and h for its next first draft."""
        taps = self.target_model.aux_hidden  # [step tokens, n_aux * H_target]
        self.target_model.aux_hidden = None  # used once; never kept across steps
        spans = [span for span in spans if span.token_ids]
        chunks, rows, lasts = [], [], []
        for span in spans:
            state = self._state(span.request)
            if state.num_computed != span.start:
                # A new request whose prompt starts in the prefix cache (its blocks' head KV was
                # written when they were computed), or positions the target computes again.
                state.num_computed = span.start
                state.last_token = state.last_hidden = None
            table = self.block_manager.get_block_table(span.request.request_id)
            chunks.append(SeqChunk(span.token_ids, span.start, table, 0))
            rows.append(range(span.row, span.row + len(span.token_ids)))
            lasts.append(len(span.token_ids))
        if not chunks:
            return
        assert taps is not None, "the target ran without its taps"
        device = self.runner.device
        start = device.mark()
        index = self.runner.device.tensor([r for span_rows in rows for r in span_rows], torch.int64)
        hidden = self.head.combine(taps[index])  # [num_tokens, H]
        self.runner.kv_forward(chunks, hidden)
        ends = list(itertools.accumulate(lasts))
        last = hidden[self.runner.device.tensor([e - 1 for e in ends], torch.int64)]  # [spans, H]
        for i, span in enumerate(spans):
            state = self._states[span.request.request_id]
            state.num_computed = span.start + len(span.token_ids)
            state.last_token, state.last_hidden = span.token_ids[-1], last[i]
        self.extend_marks = (start, device.mark(), ends[-1])

    # ------------------------------------------------------------------ drafting

    def _first(
        self, requests: Sequence[Request], max_lengths: Sequence[int]
    ) -> tuple[list[tuple[Request, int]], torch.Tensor | None, int]:
        """One forward at each drafting request's last kept position, from its kept h."""
        drafting, chunks, hidden = [], [], []
        self._chain = {}  # the last propose's outputs are not needed any more
        for request, k in zip(requests, max_lengths, strict=True):
            state = self._states.get(request.request_id)
            if (
                k <= 0
                or state is None
                or state.last_token is None
                or state.last_hidden is None
                or state.num_preemptions != request.num_preemptions
                or state.num_computed != request.num_computed_tokens
            ):
                continue
            drafting.append((request, k))
            table = self.block_manager.get_block_table(request.request_id)
            chunks.append(SeqChunk([state.last_token], state.num_computed - 1, table, 1))
            hidden.append(state.last_hidden)
        if not drafting:
            return drafting, None, 0
        out = self.runner.hidden_forward(chunks, torch.stack(hidden))  # [num_drafting, H]
        for i, (request, _) in enumerate(drafting):
            self._chain[request.request_id] = out[i]
        return drafting, self._logits(out), 0

    def _next(self, active: list[tuple[Request, int]], drafted: Drafted) -> torch.Tensor:
        """Feed each active request's latest draft with the head's own last output as h."""
        chunks, hidden = [], []
        for request, _ in active:
            ids = drafted[request.request_id][0]
            # Head position of the draft just made: it is token num_tokens - 1 + len(ids), so
            # the head pairs it with position num_tokens - 2 + len(ids).
            position = request.num_tokens - 2 + len(ids)
            table = self.block_manager.get_block_table(request.request_id)
            chunks.append(SeqChunk([ids[-1]], position, table, 1))
            hidden.append(self._chain[request.request_id])
        out = self.runner.hidden_forward(chunks, torch.stack(hidden))  # [num_active, H]
        for i, (request, _) in enumerate(active):
            self._chain[request.request_id] = out[i]
        return self._logits(out)

    def _logits(self, out: torch.Tensor) -> torch.Tensor:
        """Pre-norm outputs [rows, H] -> logits over the target's vocabulary (-inf off the
        draft vocabulary) [rows, vocab_size]."""
        return self.head.to_target(self.head.compute_logits(out), self.vocab_size)


def extend_spans(
    scheduled: Sequence[tuple[Request, SeqChunk]], results: Sequence[object]
) -> list[ExtendSpan]:
    """What the target computed and kept in a step, per request, in the step's row order: a
    prompt chunk short of the end keeps all its positions; a chunk that samples keeps its known
    tokens and the drafts accepted, and the token after each is known now."""
    spans, row = [], 0
    step_results = iter(results)
    for request, chunk in scheduled:
        n = len(chunk.token_ids)
        if not chunk.num_logits:
            following = request.all_token_ids[chunk.start + 1 : chunk.start + n + 1]
            spans.append(ExtendSpan(request, chunk.start, following, row))
        else:
            result = next(step_results)
            num_drafts = chunk.num_logits - 1
            known = list(chunk.token_ids[: n - num_drafts])
            true = known + list(result.token_ids)  # type: ignore[attr-defined]
            kept = len(known) + result.num_accepted  # type: ignore[attr-defined]
            spans.append(ExtendSpan(request, chunk.start, true[1 : kept + 1], row))
        row += n
    return spans
