"""The logits processing before sampling, each step a function of its row alone (the order is
`Sampler.process`'s): logit_bias, the min_tokens ban, repetition / frequency / presence penalties
(sparse: only a row's history changes), and temperature.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import torch

from engine.runtime.device import to_device
from engine.sampling.rows import SamplingRow

NEG_INF = float("-inf")


def min_tokens_ban(row: SamplingRow, eos_token_ids: Sequence[int]) -> tuple[int, ...]:
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
    rows_t = host_to(device, [row_ids[j] for j in kept], torch.int64)
    cols_t = host_to(device, [token_ids[j] for j in kept], torch.int64)
    vals_t = host_to(device, [values[j] for j in kept], logits.dtype)
    logits.index_put_((rows_t, cols_t), vals_t, accumulate=add)


def add_logit_bias(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    row_ids: list[int] = []
    token_ids: list[int] = []
    values: list[float] = []
    for i, row in enumerate(rows):
        for token_id, bias in row.params.logit_bias.items():
            row_ids.append(i)
            token_ids.append(token_id)
            values.append(bias)
    _set_entries(logits, row_ids, token_ids, values, add=True)


def ban_until_min_tokens(
    logits: torch.Tensor, rows: Sequence[SamplingRow], eos_token_ids: Sequence[int]
) -> None:
    row_ids: list[int] = []
    token_ids: list[int] = []
    for i, row in enumerate(rows):
        banned = min_tokens_ban(row, eos_token_ids)
        row_ids.extend([i] * len(banned))
        token_ids.extend(banned)
    _set_entries(logits, row_ids, token_ids, [NEG_INF] * len(token_ids), add=False)


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


def host_to(device: torch.device, values: Sequence[float], dtype: torch.dtype) -> torch.Tensor:
    """Host values as a tensor on `device` (built on the host, copied without blocking)."""
    return to_device(torch.tensor(values, dtype=dtype, device="cpu"), device)


def _per_row(values: list[float], device: torch.device) -> torch.Tensor:
    return host_to(device, values, torch.float32)  # [n]


def as_column(values: list[float], device: torch.device) -> torch.Tensor:
    return _per_row(values, device).unsqueeze(1)  # [n, 1]


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
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


def apply_temperature(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    # Greedy rows (and temperature-1 rows) divide by one, which is exact.
    temps = [1.0 if row.params.is_greedy else row.params.temperature for row in rows]
    if any(t != 1.0 for t in temps):
        logits.div_(as_column(temps, logits.device))
