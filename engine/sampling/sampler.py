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
step (batch invariance); `_keep_floors` says how top_p keeps to it.

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
from itertools import chain

import torch

from engine.kernels import argmax_rows
from engine.runtime.device import to_device
from engine.sampling.counter_rng import exponentials, row_keys
from engine.sampling_params import SamplingParams
from engine.structured.masks import TokenMasks, apply_masks, let_grammar_end

_NEG_INF = float("-inf")
# The narrowest head a top_p row with a top_k sums over (see `_head_width`).
_MIN_HEAD_WIDTH = 64


@dataclass(frozen=True)
class SamplingRow:
    """One row of logits to sample: the request's params and its token history."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # tokens generated BEFORE this row's token
    # Key of the row's randomness (`Request.random_key`); None: a fresh random key when sampled.
    random_key: int | None


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
        _add_logit_bias(out, rows)
        ended = None
        if masks is not None:
            apply_masks(out, masks)
            ended = self._grammar_rows_under_min_tokens(out, rows, masks)
        _ban_until_min_tokens(out, rows, self.eos_token_ids)
        if ended is not None:
            let_grammar_end(out, *ended)
        _apply_penalties(out, rows)
        _apply_temperature(out, rows)
        _truncate(out, rows)
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
            idx = _host_to(processed.device, random_idx, torch.int64)
            token_ids[idx] = _exponential_race(processed[idx], [rows[i] for i in random_idx])
        return with_logprobs(processed, token_ids, rows)

    def _grammar_rows_under_min_tokens(
        self, out: torch.Tensor, rows: Sequence[SamplingRow], masks: TokenMasks
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The masked rows min_tokens bans tokens in, and their logits before the ban."""
        ids = [i for i in masks.row_ids if _min_tokens_ban(rows[i], self.eos_token_ids)]
        if not ids:
            return None
        idx = _host_to(out.device, ids, torch.int64)
        return idx, out[idx].clone()

    def _needs_processing(self, rows: Sequence[SamplingRow]) -> bool:
        for row in rows:
            params = row.params
            if not params.is_greedy or params.logit_bias or params.has_penalties:
                return True
            if _min_tokens_ban(row, self.eos_token_ids):
                return True
        return False

    def _check(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
        if logits.dim() != 2 or logits.shape[1] != self.vocab_size:
            raise ValueError(
                f"logits must be [num_rows, {self.vocab_size}], got {tuple(logits.shape)}."
            )
        if logits.shape[0] != len(rows):
            raise ValueError(f"{logits.shape[0]} logit rows but {len(rows)} sampling rows.")


def _min_tokens_ban(row: SamplingRow, eos_token_ids: Sequence[int]) -> tuple[int, ...]:
    """Token ids banned for this row by min_tokens (empty once enough tokens exist)."""
    params = row.params
    if len(row.output_token_ids) >= params.min_tokens:
        return ()
    eos = () if params.ignore_eos else tuple(eos_token_ids)
    return (*eos, *params.stop_token_ids)


def _set_entries(
    logits: torch.Tensor, row_ids: list[int], token_ids: list[int], values: list[float], add: bool
) -> None:
    """logits[row_ids[j], token_ids[j]] (+)= values[j], skipping ids outside the vocabulary."""
    vocab_size = logits.shape[1]
    kept = [j for j, t in enumerate(token_ids) if 0 <= t < vocab_size]
    if not kept:
        return
    device = logits.device
    rows_t = _host_to(device, [row_ids[j] for j in kept], torch.int64)
    cols_t = _host_to(device, [token_ids[j] for j in kept], torch.int64)
    vals_t = _host_to(device, [values[j] for j in kept], logits.dtype)
    logits.index_put_((rows_t, cols_t), vals_t, accumulate=add)


def _add_logit_bias(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    row_ids: list[int] = []
    token_ids: list[int] = []
    values: list[float] = []
    for i, row in enumerate(rows):
        for token_id, bias in row.params.logit_bias.items():
            row_ids.append(i)
            token_ids.append(token_id)
            values.append(bias)
    _set_entries(logits, row_ids, token_ids, values, add=True)


def _ban_until_min_tokens(
    logits: torch.Tensor, rows: Sequence[SamplingRow], eos_token_ids: Sequence[int]
) -> None:
    row_ids: list[int] = []
    token_ids: list[int] = []
    for i, row in enumerate(rows):
        banned = _min_tokens_ban(row, eos_token_ids)
        row_ids.extend([i] * len(banned))
        token_ids.extend(banned)
    _set_entries(logits, row_ids, token_ids, [_NEG_INF] * len(token_ids), add=False)


def _flat_positions(
    token_lists: Sequence[Sequence[int]], row_ids: list[int], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """[total_tokens] int64: row * vocab_size + token for every token of every list, i.e. each
    token's position in the flattened [num_rows * vocab_size] logits."""
    lengths = torch.tensor([len(ids) for ids in token_lists], dtype=torch.int64, device="cpu")
    tokens = torch.tensor(list(chain.from_iterable(token_lists)), dtype=torch.int64, device="cpu")
    row_of = torch.tensor(row_ids, dtype=torch.int64, device="cpu")
    rows_of_tokens = torch.repeat_interleave(row_of, lengths)
    return to_device(rows_of_tokens * vocab_size + tokens, device)


def _host_to(device: torch.device, values: Sequence[float], dtype: torch.dtype) -> torch.Tensor:
    """Host values as a tensor on `device` (built on the host, copied without blocking)."""
    return to_device(torch.tensor(values, dtype=dtype, device="cpu"), device)


def _per_row(values: list[float], device: torch.device) -> torch.Tensor:
    return _host_to(device, values, torch.float32)  # [n]


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return _per_row(values, device).unsqueeze(1)  # [n, 1]


def _apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Penalties touch only the tokens of each row's history, so they are applied sparsely: the
    counts come from a unique over the history, never from a dense [num_rows, vocab] table."""
    device, vocab_size = logits.device, logits.shape[1]
    flat = logits.view(-1)  # [num_rows * vocab_size], writes land in logits
    rep_ids = [i for i, row in enumerate(rows) if row.params.repetition_penalty != 1.0]
    if rep_ids:
        seen = [(*rows[i].prompt_token_ids, *rows[i].output_token_ids) for i in rep_ids]
        positions = torch.unique(_flat_positions(seen, rep_ids, vocab_size, device))  # [num_seen]
        rep = _per_row([row.params.repetition_penalty for row in rows], device)
        rep = rep[positions // vocab_size]
        values = flat[positions]
        flat[positions] = torch.where(values > 0, values / rep, values * rep)
    count_ids = [
        i
        for i, row in enumerate(rows)
        if row.params.frequency_penalty != 0.0 or row.params.presence_penalty != 0.0
    ]
    if count_ids:
        outputs = [rows[i].output_token_ids for i in count_ids]
        positions, counts = torch.unique(
            _flat_positions(outputs, count_ids, vocab_size, device), return_counts=True
        )  # [num_distinct] each
        row_of = positions // vocab_size
        frequency = _per_row([row.params.frequency_penalty for row in rows], device)[row_of]
        presence = _per_row([row.params.presence_penalty for row in rows], device)[row_of]
        values = flat[positions] - frequency * counts.to(torch.float32)
        flat[positions] = values - presence


def _apply_temperature(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    # Greedy rows (and temperature-1 rows) divide by one, which is exact.
    temps = [1.0 if row.params.is_greedy else row.params.temperature for row in rows]
    if any(t != 1.0 for t in temps):
        logits.div_(_column(temps, logits.device))


def _truncate(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """top_k, then top_p, then min_p, on the random rows that use any of them.

    Every row's result is a function of that row alone, never of the rest of its step (batch
    invariance): see `_keep_floors` for top_k and top_p; min_p's softmax runs over each full row.
    """
    vocab_size = logits.shape[1]
    trunc_idx = [
        i
        for i, row in enumerate(rows)
        if not row.params.is_greedy
        and (0 < row.params.top_k < vocab_size or row.params.top_p < 1.0 or row.params.min_p > 0)
    ]
    if not trunc_idx:
        return
    device = logits.device
    params = [rows[i].params for i in trunc_idx]
    idx = _host_to(device, trunc_idx, torch.int64)
    sub = logits[idx]  # [num_trunc, vocab_size]
    top_ks = [p.top_k if 0 < p.top_k < vocab_size else 0 for p in params]
    top_ps = [p.top_p for p in params]
    if any(top_ks) or any(p < 1.0 for p in top_ps):
        sub.masked_fill_(sub < _keep_floors(sub, top_ks, top_ps), _NEG_INF)
    if any(p.min_p > 0 for p in params):
        probs = sub.softmax(dim=-1)  # [num_trunc, vocab_size]
        floor = _column([p.min_p for p in params], device) * probs.amax(dim=-1, keepdim=True)
        sub.masked_fill_(probs < floor, _NEG_INF)
    logits[idx] = sub


def _keep_floors(sub: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
    """[n, 1] the smallest logit each row of sub [n, vocab] keeps under its top_k and top_p
    (-inf where neither is on).

    The k-th largest logit is exact whatever else is sorted beside it, so the top_k-only rows
    share one topk. The top_p sums are not: a softmax over [n, width] associates its float sum
    differently for another width, which can move a cutoff that lies at a boundary. So each
    top_p row sums over a head whose width its own top_k and logits decide (`_head_width`), and
    rows of equal width share one sort.
    """
    floors = torch.full((sub.shape[0], 1), _NEG_INF, dtype=sub.dtype, device=sub.device)  # [n, 1]
    k_only = [j for j, (k, p) in enumerate(zip(top_ks, top_ps, strict=True)) if k and p >= 1.0]
    if k_only:
        index = _row_index(k_only, sub)
        top_ks_only = [top_ks[j] for j in k_only]
        head = sub[index].topk(max(top_ks_only), dim=-1).values  # [num_k_only, max_k]
        floors[index] = _kth_largest(head, top_ks_only)
    p_rows = [j for j, p in enumerate(top_ps) if p < 1.0]
    widths = {j: _head_width(top_ks[j], sub.shape[1]) for j in p_rows}
    while p_rows:  # usually one round; another only where ties with the k-th logit spill
        spills = [
            (ids, _nucleus_floors(sub, ids, width, top_ks, top_ps, floors))
            for width, ids in _by_width(p_rows, widths)
        ]
        p_rows = _spilled(spills)
        for j in p_rows:
            widths[j] = min(4 * widths[j], sub.shape[1])
    return floors


def _head_width(top_k: int, vocab_size: int) -> int:
    """Width of the sorted head a top_p row sums over, from its own top_k alone: all of the row
    without one, else a power of two above top_k (the extra column shows ties spilling),
    at least _MIN_HEAD_WIDTH so that rows with different small top_k share a group."""
    if top_k == 0:
        return vocab_size
    width = _MIN_HEAD_WIDTH
    while width <= top_k:
        width *= 2
    return min(width, vocab_size)


def _by_width(row_ids: list[int], widths: dict[int, int]) -> list[tuple[int, list[int]]]:
    """The rows grouped by head width, each group in ascending row order."""
    groups: dict[int, list[int]] = {}
    for j in row_ids:
        groups.setdefault(widths[j], []).append(j)
    return sorted(groups.items())


def _nucleus_floors(
    sub: torch.Tensor,
    ids: list[int],
    width: int,
    top_ks: list[int],
    top_ps: list[float],
    floors: torch.Tensor,
) -> torch.Tensor | None:
    """Writes floors[ids] for top_p rows whose heads have this width. Returns [m] bool: the rows
    whose head may miss a finite logit (ties with the k-th one past it); None for whole rows."""
    index = _row_index(ids, sub)
    group = sub[index]  # [m, vocab_size]
    if width < sub.shape[1]:
        head = group.topk(width, dim=-1).values  # [m, width], descending
    else:
        head = group.sort(dim=-1, descending=True).values  # [m, vocab_size]
    kth = _kth_largest(head, [top_ks[j] for j in ids])  # [m, 1]
    head = head.masked_fill(head < kth, _NEG_INF)
    # The cutoff can only fall below kth where rounding leaves the mass short of top_p.
    floors[index] = torch.maximum(kth, _top_p_cutoff(head, [top_ps[j] for j in ids]))
    return head[:, -1].isfinite() if width < sub.shape[1] else None


def _spilled(spills: list[tuple[list[int], torch.Tensor | None]]) -> list[int]:
    """The rows whose heads must widen, in ascending order; one host sync for a whole round."""
    checks = [(ids, flags) for ids, flags in spills if flags is not None]
    if not checks:
        return []
    ids = [j for group, _ in checks for j in group]
    is_spilled = torch.cat([flags for _, flags in checks]).tolist()
    return sorted(j for j, spilled in zip(ids, is_spilled, strict=True) if spilled)


def _row_index(ids: list[int], sub: torch.Tensor) -> slice | torch.Tensor:
    """Index of the rows ids (ascending) of sub: a plain slice when they are all of them, so
    the common single group neither gathers nor scatters a copy."""
    if len(ids) == sub.shape[0]:
        return slice(None)
    return _host_to(sub.device, ids, torch.int64)


def _kth_largest(sorted_logits: torch.Tensor, top_ks: list[int]) -> torch.Tensor:
    """[n, 1] threshold: the k-th largest logit per row, -inf where top_k is off (k == 0)."""
    device = sorted_logits.device
    k = _host_to(device, [max(k, 1) for k in top_ks], torch.int64).unsqueeze(1)  # [n, 1]
    kth = sorted_logits.gather(1, k - 1)
    is_off = _host_to(device, [k == 0 for k in top_ks], torch.bool).unsqueeze(1)
    return kth.masked_fill(is_off, _NEG_INF)


def _top_p_cutoff(sorted_logits: torch.Tensor, top_ps: list[float]) -> torch.Tensor:
    """[n, 1] threshold: the smallest logit of the top_p nucleus (every top_p < 1).

    sorted_logits [n, width] holds every token of each row that top_k left finite; the result
    depends on width (the softmax sum), so callers fix the width per row.
    """
    width = sorted_logits.shape[1]
    probs = sorted_logits.softmax(dim=-1)  # [n, width], descending
    mass = _prefix_sums(probs)  # [n, width]
    top_p = _column(top_ps, sorted_logits.device)
    # Tokens before the one whose cumulative mass reaches top_p, plus that one.
    num_kept = ((mass < top_p).sum(dim=-1, keepdim=True) + 1).clamp_max(width)  # [n, 1]
    return sorted_logits.gather(1, num_kept - 1)


def _prefix_sums(values: torch.Tensor) -> torch.Tensor:
    """[n, width] -> [n, width] inclusive sums along each row, each column's sum associated the
    same way whatever the width, the number of rows or the device (Hillis-Steele: log2(width)
    elementwise adds).

    Not torch.cumsum: on CUDA it scans a lone row with CUB and several rows in chunks whose
    length depends on the number of rows, so a row's cumulative mass would change, in its last
    bit, with the number of rows that share its head width.
    """
    width = values.shape[1]
    sums, spare = values.clone(), torch.empty_like(values)
    shift = 1
    while shift < width:
        spare[:, :shift] = sums[:, :shift]
        torch.add(sums[:, shift:], sums[:, :-shift], out=spare[:, shift:])
        sums, spare = spare, sums
        shift *= 2
    return sums


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
