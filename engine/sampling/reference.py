"""Plain one-row-at-a-time reference for `engine.sampling.sampler`, the oracle the tests trust.

Written for clarity, not speed: each step of the processing order documented in
`engine/sampling/sampler.py` is a few lines on a single [vocab] row. Only tests (and the tests of the
speculative rejection sampler) use it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

from engine.sampling.rows import SamplingRow

_NEG_INF = float("-inf")


def process_reference(
    logits_row: torch.Tensor,
    row: SamplingRow,
    *,
    eos_token_ids: Sequence[int],
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits_row [vocab] -> processed float32 [vocab]; masked tokens are -inf. `allowed`
    [vocab] bool: the tokens a grammar allows (None: no grammar)."""
    params = row.params
    x = logits_row.to(torch.float32, copy=True)  # [vocab_size]
    vocab_size = x.shape[0]

    for token_id, bias in params.logit_bias.items():
        if token_id < vocab_size:
            x[token_id] += bias

    if allowed is not None:
        x[~allowed] = _NEG_INF

    if len(row.output_token_ids) < params.min_tokens:
        banned = set(params.stop_token_ids)
        if not params.ignore_eos:
            banned |= set(eos_token_ids)
        before_ban = x.clone()
        for token_id in banned:
            if 0 <= token_id < vocab_size:
                x[token_id] = _NEG_INF
        if allowed is not None and bool(torch.isneginf(x).all()):
            x = before_ban  # the grammar allows only the end: it wins over min_tokens

    if params.repetition_penalty != 1.0:
        rp = params.repetition_penalty
        for token_id in set(row.prompt_token_ids) | set(row.output_token_ids):
            x[token_id] = x[token_id] / rp if x[token_id] > 0 else x[token_id] * rp
    for token_id, count in Counter(row.output_token_ids).items():
        x[token_id] = x[token_id] - params.frequency_penalty * count
        x[token_id] = x[token_id] - params.presence_penalty

    if params.is_greedy:
        return x
    x = x / params.temperature

    if 0 < params.top_k < vocab_size:
        kth_largest = torch.topk(x, params.top_k).values[-1]
        x[x < kth_largest] = _NEG_INF

    if params.top_p < 1.0:
        probs = torch.softmax(x, dim=0)
        sorted_probs = torch.sort(probs, descending=True).values
        mass = torch.cumsum(sorted_probs, dim=0)
        # Keep the tokens before the one whose cumulative mass reaches top_p, and that one.
        num_kept = min(int((mass < params.top_p).sum()) + 1, vocab_size)
        x[probs < sorted_probs[num_kept - 1]] = _NEG_INF

    if params.min_p > 0.0:
        probs = torch.softmax(x, dim=0)
        x[probs < params.min_p * probs.max()] = _NEG_INF
    return x


def sample_reference(
    logits_row: torch.Tensor,
    row: SamplingRow,
    *,
    eos_token_ids: Sequence[int],
    allowed: torch.Tensor | None = None,
) -> int:
    """One token for one row: argmax when greedy, else a multinomial draw from the processed
    distribution, from a torch generator seeded with row.random_key when it has one (the
    per-request generator the counter-based draws of `engine/sampling/sampler.py` are held against)."""
    processed = process_reference(logits_row, row, eos_token_ids=eos_token_ids, allowed=allowed)
    if row.params.is_greedy:
        return int(torch.argmax(processed))
    probs = torch.softmax(processed, dim=0)
    generator = None
    if row.random_key is not None:
        generator = torch.Generator(device=probs.device).manual_seed(row.random_key)
    return int(torch.multinomial(probs, 1, generator=generator))
