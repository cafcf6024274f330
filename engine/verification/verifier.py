"""Turns one step's logits into the tokens each request emits: plain sampling, or verification
of draft tokens by speculative rejection sampling.

A request that verifies k drafts owns k + 1 consecutive logit rows (the target's p_1 .. p_{k+1}
from the single forward). Row j is processed with the request's history extended by d_1 .. d_j,
so penalties and min_tokens advance position by position inside the window exactly as they
would without speculation, and row j draws its randomness from the key of its own output position
(`Request.random_key`; the draws of all rows are one batched counter computation,
`engine/sampling/counter_rng.py`). Two verification paths, both exact:

- one-hot drafts (n-gram, predicted outputs, a greedy draft model) and greedy requests: every row
  samples its token x_j exactly as plain sampling would; drafts are accepted while d_j == x_j and
  the request emits x_1 .. x_{a+1}. Output is token-identical to non-speculative decoding.
- drafts with a distribution q (a sampling draft model): accept d_j with probability
  min(1, p_j(d_j) / q_j(d_j)), recover from norm(max(0, p_j - q_j)), bonus from p_{k+1}.

Logprobs of every emitted token come from the target's processed distribution at its row.

A request under a grammar (structured outputs) has every row masked with the grammar state its
drafts reach: row j with the state after d_1 .. d_j. A draft the grammar forbids has probability
0 at its row, so it is rejected there and the rows after it are never read (they stay unmasked).
The state rolls back after the masks are built; the engine advances it by the emitted tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.core.drafts import Draft
from engine.core.emitted import StepTokens
from engine.core.request import Request
from engine.outputs import TokenLogprob
from engine.runtime.device import to_device
from engine.sampling.counter_rng import row_keys
from engine.sampling.rows import VERIFY_STREAM, SamplingRow, sampling_rows
from engine.sampling.sampler import Sampler, SamplerOutput, with_logprobs
from engine.structured.masks import TokenMasks, new_masks
from engine.verification.rejection import rejection_sample, verify_by_sampling


class Verifier:
    """Samples and verifies for every request that has logit rows this step."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    @staticmethod
    def rows(
        items: Sequence[tuple[Request, Draft | None]], device: torch.device
    ) -> list[SamplingRow]:
        """The sampling rows of the items in order (1 + len(draft) each), built on the host
        before the step is launched: a request's state may move on while its step runs."""
        return [
            row
            for req, d in items
            for row in sampling_rows(req, list(d.token_ids) if d is not None else [], device)
        ]

    def run(
        self,
        logits: torch.Tensor,
        items: Sequence[tuple[Request, Draft | None]],
        rows: list[SamplingRow] | None = None,
    ) -> list[StepTokens]:
        """logits [num_rows, vocab]: rows of the items in order (1 + len(draft) each); `rows`
        their sampling rows (`Verifier.rows`), built here when not given."""
        drafts = [list(d.token_ids) if d is not None else [] for _, d in items]
        if rows is None:
            rows = self.rows(items, logits.device)
        starts = _row_starts(drafts)
        masks = grammar_masks([r for r, _ in items], drafts, starts, self.sampler.vocab_size)
        is_prob = [
            d is not None and d.probs is not None and not r.params.is_greedy for r, d in items
        ]
        if not any(is_prob):
            sampled = self.sampler.sample(logits, rows, masks)
            verified = verify_by_sampling(sampled.token_ids, drafts)
            return _results(
                verified.output_token_ids, verified.num_accepted, drafts, starts, sampled
            )
        return self._run_with_probs(logits, items, drafts, rows, starts, is_prob, masks)

    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        """One token per row of a step that verifies nothing and masks nothing (an overlapped
        step): the sampler's tensors as they are, nothing read back to the host."""
        return self.sampler.sample(logits, rows)

    def _run_with_probs(
        self,
        logits: torch.Tensor,
        items: Sequence[tuple[Request, Draft | None]],
        drafts: list[list[int]],
        rows: list[SamplingRow],
        starts: list[int],
        is_prob: list[bool],
        masks: TokenMasks | None,
    ) -> list[StepTokens]:
        processed = self.sampler.process(logits, rows, masks)  # [num_rows, vocab_size]
        tokens: list[list[int]] = [[] for _ in items]
        accepted = [0] * len(items)
        plain = [i for i, p in enumerate(is_prob) if not p]
        if plain:
            idx = [starts[i] + j for i in plain for j in range(len(drafts[i]) + 1)]
            sampled = self.sampler.sample_processed(processed[idx], [rows[r] for r in idx])
            result = verify_by_sampling(sampled.token_ids, [drafts[i] for i in plain])
            for i, out, num in zip(
                plain, result.output_token_ids, result.num_accepted, strict=True
            ):
                tokens[i], accepted[i] = out, num
        spec = [i for i, p in enumerate(is_prob) if p]
        idx = [starts[i] + j for i in spec for j in range(len(drafts[i]) + 1)]
        result = rejection_sample(
            processed[idx],
            [drafts[i] for i in spec],
            torch.cat([items[i][1].probs for i in spec]),  # type: ignore[union-attr, misc]
            _verify_keys([items[i][0] for i in spec], [drafts[i] for i in spec], logits.device),
        )
        for i, out, num in zip(spec, result.output_token_ids, result.num_accepted, strict=True):
            tokens[i], accepted[i] = out, num
        # Logprobs of the emitted tokens, each at its own row.
        emit_rows = [starts[i] + j for i, out in enumerate(tokens) for j in range(len(out))]
        emitted = to_device(
            torch.tensor([t for out in tokens for t in out], dtype=torch.int64, device="cpu"),
            processed.device,
        )
        scored = with_logprobs(processed[emit_rows], emitted, [rows[r] for r in emit_rows])
        return _results(tokens, accepted, drafts, _row_starts([t[1:] for t in tokens]), scored)


def _verify_keys(
    requests: Sequence[Request], drafts: Sequence[Sequence[int]], device: torch.device
) -> torch.Tensor:
    """[num_rows] int64 on `device`: the VERIFY_STREAM key of every row of the requests
    verifying drafts with a distribution, in row order; one copy for the whole step."""
    keys = [
        request.random_key(len(request.output_token_ids) + j, VERIFY_STREAM)
        for request, ids in zip(requests, drafts, strict=True)
        for j in range(len(ids) + 1)
    ]
    return row_keys(keys, device)


def grammar_masks(
    requests: Sequence[Request],
    drafts: Sequence[Sequence[int]],
    starts: Sequence[int],
    vocab_size: int,
) -> TokenMasks | None:
    """The masks of every row of the requests under a grammar (None when no request has one):
    row j of a request with the state after its first j drafts, each grammar rolled back after.
    A row past a draft the grammar forbids, or past the grammar's end, stays unmasked: it is
    never read."""
    grammar_ids = [i for i, r in enumerate(requests) if r.grammar is not None]
    if not grammar_ids:
        return None
    row_ids = [starts[i] + j for i in grammar_ids for j in range(len(drafts[i]) + 1)]
    packed = new_masks(len(row_ids), vocab_size)  # [num_masked_rows, words]
    row = 0
    for i in grammar_ids:
        state, ids = requests[i].grammar, drafts[i]
        depth = 0  # drafts the state has taken
        for j in range(len(ids) + 1):
            if j and depth == j - 1 and not state.is_terminated and state.accept(ids[j - 1]):
                depth = j
            if depth == j and not state.is_terminated:
                state.fill_mask(packed, row)
            row += 1
        state.rollback(depth)
    return TokenMasks(row_ids, packed)


def _row_starts(drafts: Sequence[Sequence[int]]) -> list[int]:
    starts, start = [], 0
    for ids in drafts:
        starts.append(start)
        start += len(ids) + 1
    return starts


def _results(
    tokens: Sequence[list[int]],
    accepted: Sequence[int],
    drafts: Sequence[Sequence[int]],
    starts: Sequence[int],
    scored: SamplerOutput,
) -> list[StepTokens]:
    """StepTokens per request; `scored` holds logprobs at rows starts[i] + j for token j."""
    logprobs = None
    if scored.logprobs is not None and scored.top_token_ids is not None:
        assert scored.top_logprobs is not None
        logprobs = (
            scored.logprobs.tolist(),
            scored.top_token_ids.tolist(),
            scored.top_logprobs.tolist(),
        )
    results = []
    for out, num, ids, start in zip(tokens, accepted, drafts, starts, strict=True):
        entries = None
        if logprobs is not None:
            chosen, top_ids, top_values = logprobs
            entries = [
                TokenLogprob(
                    t, chosen[start + j], tuple(top_ids[start + j]), tuple(top_values[start + j])
                )
                for j, t in enumerate(out)
            ]
        results.append(StepTokens(list(out), len(ids), num, entries))
    return results


def pack(sampled: SamplerOutput) -> torch.Tensor:
    """A step's sampled tokens and their logprobs as one int64 tensor on their device, so that
    one copy brings them to the host: [ids (n) | top ids (n * w) | logprob bits (n) | top
    logprob bits (n * w)], the float32 values as their bit patterns."""
    parts = [sampled.token_ids]
    if sampled.logprobs is not None:
        assert sampled.top_token_ids is not None and sampled.top_logprobs is not None
        parts += [
            sampled.top_token_ids.flatten(),
            sampled.logprobs.view(torch.int32).to(torch.int64),
            sampled.top_logprobs.flatten().view(torch.int32).to(torch.int64),
        ]
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def unpack(host: torch.Tensor, num_rows: int, width: int | None) -> SamplerOutput:
    """`pack`'s tensor, on the host, back into a SamplerOutput (width: the top logprobs', None
    when no row asked for logprobs)."""
    ids = host[:num_rows]
    if width is None:
        return SamplerOutput(ids, None, None, None)
    n, w = num_rows, width
    top_ids = host[n : n + n * w].view(n, w)
    logprobs = host[n + n * w : 2 * n + n * w].to(torch.int32).view(torch.float32)
    top = host[2 * n + n * w :].to(torch.int32).view(torch.float32).view(n, w)
    return SamplerOutput(ids, logprobs, top_ids, top)


def sampled_results(sampled: SamplerOutput, num_rows: int) -> list[StepTokens]:
    """StepTokens of rows that each emitted one token and verified nothing."""
    tokens = [[t] for t in sampled.token_ids.tolist()]
    return _results(tokens, [0] * num_rows, [[]] * num_rows, list(range(num_rows)), sampled)
