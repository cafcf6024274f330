"""Batched sampler: turns one step's logits into tokens, each row under its own SamplingParams.

Processing order (`Sampler.process`; `engine/sampling/reference.py` spells out the same steps one
row at a time and is the oracle the tests hold this module against):

1. logit_bias is added.
1b. A grammar (structured outputs) masks the tokens it does not allow (-inf).
2. min_tokens: while len(output_token_ids) < min_tokens, the EOS ids (unless ignore_eos) and
   stop_token_ids are banned (-inf). Where a grammar allows nothing else (its document is
   complete and only the end may follow), the grammar wins: the row keeps what it allows.
3. Penalties. repetition_penalty acts on tokens present in the prompt OR the output
   (logit / rp if logit > 0 else logit * rp); then frequency_penalty * count and
   presence_penalty * (count > 0) are subtracted, counting the output only (OpenAI semantics).
   Only the tokens of a row's history change, so this step is sparse: O(history), not O(vocab).
4. Temperature divides the logits of random rows. Greedy rows (temperature 0) stop here: they are
   neither scaled nor truncated.
5. top_k (0 = off): keep the tokens whose logit is >= the k-th largest (ties at the edge stay).
6. top_p, over the distribution left by top_k: keep the smallest prefix of the tokens sorted by
   descending probability whose mass reaches top_p; the top token always stays, and so do tokens
   tied with the last kept one.
7. min_p: keep the tokens whose probability (of what is left) is >= min_p * the max probability.

Each row's processing is a function of that row alone, bit for bit, whatever else shares its
step (batch invariance); `truncation.keep_floors` says how top_p keeps to it.

Truncated and banned tokens are -inf, so log_softmax of the processed logits is the distribution
a row samples from and the one its logprobs report.

Sampling (`Sampler.sample`): greedy rows take the argmax (lowest id on ties). Random rows run an
exponential race, token = argmax(p / E) with E = -log(U) ~ Exp(1) i.i.d. per token, which draws
exactly from p. The U of every random row come from one counter-based computation
(`engine/sampling/counter_rng.py`): row r's [vocab] uniforms are a function of its `random_key` alone, so a
seeded request produces the same tokens whatever else shares its batch, and a step costs the same
few launches at any number of rows. A row without a key gets a fresh one from torch's default
generator (one draw for all of them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.kernels import argmax_rows
from engine.sampling.counter_rng import exponentials, row_keys
from engine.sampling.processing import (
    add_logit_bias,
    apply_penalties,
    apply_temperature,
    ban_until_min_tokens,
    host_to,
    min_tokens_ban,
)
from engine.sampling.rows import SamplingRow
from engine.sampling.truncation import truncate
from engine.structured.masks import TokenMasks, apply_masks, let_grammar_end


@dataclass(frozen=True)
class SamplerOutput:
    """Sampled tokens of one batch, with logprobs when some row asked for them.

    `logprobs` and `top_*` are None exactly when no row set params.logprobs; otherwise `top_*`
    have width max(params.logprobs) over the rows (0 is allowed) and a row asking fewer ignores
    the extra columns.
    """

    token_ids: torch.Tensor  # [num_rows] int64
    logprobs: torch.Tensor | None  # [num_rows] float32, logprob of the sampled token
    top_token_ids: torch.Tensor | None  # [num_rows, max_logprobs] int64, by descending logprob
    top_logprobs: torch.Tensor | None  # [num_rows, max_logprobs] float32


class Sampler:
    """Processes and samples a batch of logit rows; stateless between calls."""

    def __init__(self, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}.")
        self.vocab_size = vocab_size
        # Ids outside the vocabulary cannot be sampled, so there is nothing to ban.
        self.eos_token_ids = tuple(sorted({int(t) for t in eos_token_ids if 0 <= t < vocab_size}))

    def process(
        self,
        logits: torch.Tensor,
        rows: Sequence[SamplingRow],
        masks: TokenMasks | None = None,
    ) -> torch.Tensor:
        """logits [num_rows, vocab] (any float dtype) -> processed float32 logits, same shape.

        Masked tokens are -inf. The input tensor is not modified.
        """
        self._check(logits, rows)
        # Contiguous so that the penalties can index it flat.
        out = logits.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
        # out: [num_rows, vocab_size]
        add_logit_bias(out, rows)
        ended = None
        if masks is not None:
            apply_masks(out, masks)
            ended = self._grammar_rows_under_min_tokens(out, rows, masks)
        ban_until_min_tokens(out, rows, self.eos_token_ids)
        if ended is not None:
            let_grammar_end(out, *ended)
        apply_penalties(out, rows)
        apply_temperature(out, rows)
        truncate(out, rows)
        return out

    def sample(
        self,
        logits: torch.Tensor,
        rows: Sequence[SamplingRow],
        masks: TokenMasks | None = None,
    ) -> SamplerOutput:
        """Sample one token per row from logits [num_rows, vocab]."""
        self._check(logits, rows)
        if masks is not None or self._needs_processing(rows):
            return self.sample_processed(self.process(logits, rows, masks), rows)
        # All greedy and nothing to apply: the argmax of the logits as they are.
        return with_logprobs(logits, argmax_rows(logits), rows)

    def sample_processed(
        self, processed: torch.Tensor, rows: Sequence[SamplingRow]
    ) -> SamplerOutput:
        """Sample from logits that `process` already produced (so a caller that needs the
        processed distributions too, such as verification, processes once)."""
        token_ids = argmax_rows(processed)  # [num_rows]; random rows are overwritten below
        random_idx = [i for i, row in enumerate(rows) if not row.params.is_greedy]
        if random_idx:
            idx = host_to(processed.device, random_idx, torch.int64)
            token_ids[idx] = _exponential_race(processed[idx], [rows[i] for i in random_idx])
        return with_logprobs(processed, token_ids, rows)

    def _grammar_rows_under_min_tokens(
        self, out: torch.Tensor, rows: Sequence[SamplingRow], masks: TokenMasks
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The masked rows min_tokens bans tokens in, and their logits before the ban."""
        ids = [i for i in masks.row_ids if min_tokens_ban(rows[i], self.eos_token_ids)]
        if not ids:
            return None
        idx = host_to(out.device, ids, torch.int64)
        return idx, out[idx].clone()

    def _needs_processing(self, rows: Sequence[SamplingRow]) -> bool:
        for row in rows:
            params = row.params
            if not params.is_greedy or params.logit_bias or params.has_penalties:
                return True
            if min_tokens_ban(row, self.eos_token_ids):
                return True
        return False

    def _check(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
        if logits.dim() != 2 or logits.shape[1] != self.vocab_size:
            raise ValueError(
                f"logits must be [num_rows, {self.vocab_size}], got {tuple(logits.shape)}."
            )
        if logits.shape[0] != len(rows):
            raise ValueError(f"{logits.shape[0]} logit rows but {len(rows)} sampling rows.")


def _exponential_race(processed: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Draw one token per row from softmax(processed [n, vocab]) -> [n] int64."""
    probs = processed.softmax(dim=-1)  # [n, vocab_size]
    keys = row_keys([row.random_key for row in rows], probs.device)  # [n]
    noise = exponentials(keys, probs.shape[1])  # [n, vocab_size], E ~ Exp(1), 0 < E < inf
    return argmax_rows(probs / noise)


def with_logprobs(
    scores: torch.Tensor, token_ids: torch.Tensor, rows: Sequence[SamplingRow]
) -> SamplerOutput:
    """Package token_ids [num_rows] with their logprobs under log_softmax(scores) (the processed
    logits, or raw logits on the plain greedy path) when some row asks for logprobs."""
    widths = [row.params.logprobs for row in rows if row.params.logprobs is not None]
    if not widths:
        return SamplerOutput(token_ids, None, None, None)
    logprobs = torch.log_softmax(scores.to(torch.float32), dim=-1)  # [num_rows, vocab_size]
    sampled = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)  # [num_rows]
    width = min(max(widths), logprobs.shape[1])
    top_logprobs, top_token_ids = logprobs.topk(width, dim=-1)  # [num_rows, width] each
    return SamplerOutput(token_ids, sampled, top_token_ids, top_logprobs)
