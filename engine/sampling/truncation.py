"""Truncation of a processed row: top_k, then top_p over what top_k left, then min_p, each kept
token's logit untouched and the others -inf; every row's floors computed from that row alone, so
batch invariance holds (`keep_floors`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.sampling.processing import NEG_INF, as_column, host_to
from engine.sampling.rows import SamplingRow

# The narrowest head a top_p row with a top_k sums over (see `_head_width`).
_MIN_HEAD_WIDTH = 64


def truncate(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """top_k, then top_p, then min_p, on the random rows that use any of them.

    Every row's result is a function of that row alone, never of the rest of its step (batch
    invariance): see `keep_floors` for top_k and top_p; min_p's softmax runs over each full row.
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
    idx = host_to(device, trunc_idx, torch.int64)
    sub = logits[idx]  # [num_trunc, vocab_size]
    top_ks = [p.top_k if 0 < p.top_k < vocab_size else 0 for p in params]
    top_ps = [p.top_p for p in params]
    if any(top_ks) or any(p < 1.0 for p in top_ps):
        sub.masked_fill_(sub < keep_floors(sub, top_ks, top_ps), NEG_INF)
    if any(p.min_p > 0 for p in params):
        probs = sub.softmax(dim=-1)  # [num_trunc, vocab_size]
        floor = as_column([p.min_p for p in params], device) * probs.amax(dim=-1, keepdim=True)
        sub.masked_fill_(probs < floor, NEG_INF)
    logits[idx] = sub


def keep_floors(sub: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
    """[n, 1] the smallest logit each row of sub [n, vocab] keeps under its top_k and top_p
    (-inf where neither is on).

    The k-th largest logit is exact whatever else is sorted beside it, so the top_k-only rows
    share one topk. The top_p sums are not: a softmax over [n, width] associates its float sum
    differently for another width, which can move a cutoff that lies at a boundary. So each
    top_p row sums over a head whose width its own top_k and logits decide (`_head_width`), and
    rows of equal width share one sort.
    """
    floors = torch.full((sub.shape[0], 1), NEG_INF, dtype=sub.dtype, device=sub.device)  # [n, 1]
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
    head = head.masked_fill(head < kth, NEG_INF)
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
    return host_to(sub.device, ids, torch.int64)


def _kth_largest(sorted_logits: torch.Tensor, top_ks: list[int]) -> torch.Tensor:
    """[n, 1] threshold: the k-th largest logit per row, -inf where top_k is off (k == 0)."""
    device = sorted_logits.device
    k = host_to(device, [max(k, 1) for k in top_ks], torch.int64).unsqueeze(1)  # [n, 1]
    kth = sorted_logits.gather(1, k - 1)
    is_off = host_to(device, [k == 0 for k in top_ks], torch.bool).unsqueeze(1)
    return kth.masked_fill(is_off, NEG_INF)


def _top_p_cutoff(sorted_logits: torch.Tensor, top_ps: list[float]) -> torch.Tensor:
    """[n, 1] threshold: the smallest logit of the top_p nucleus (every top_p < 1).

    sorted_logits [n, width] holds every token of each row that top_k left finite; the result
    depends on width (the softmax sum), so callers fix the width per row.
    """
    width = sorted_logits.shape[1]
    probs = sorted_logits.softmax(dim=-1)  # [n, width], descending
    mass = prefix_sums(probs)  # [n, width]
    top_p = as_column(top_ps, sorted_logits.device)
    # Tokens before the one whose cumulative mass reaches top_p, plus that one.
    num_kept = ((mass < top_p).sum(dim=-1, keepdim=True) + 1).clamp_max(width)  # [n, 1]
    return sorted_logits.gather(1, num_kept - 1)


def prefix_sums(values: torch.Tensor) -> torch.Tensor:
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
