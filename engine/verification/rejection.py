"""Verification of draft tokens: which drafts a request keeps, and the one token it adds after them.

Terminology, for one request and one verify step:
- drafts d_1..d_k (k >= 0), proposed by a drafter;
- target distributions p_1..p_{k+1}, from the target's single forward pass: p_j is the target's
  distribution for the token at draft position j, p_{k+1} the one for the token after all drafts;
- draft distributions q_1..q_k, from which d_1..d_k were drawn;
- accepted: the drafts kept, always a prefix d_1..d_a (0 <= a <= k); bonus/recovered excluded;
- recovered: the token sampled at the first rejection (position a + 1 <= k) from
  norm(max(0, p_{a+1} - q_{a+1}));
- bonus: the token sampled from p_{k+1} when all k drafts are accepted.
A request emits a + 1 tokens: its accepted drafts, then one recovered or bonus token.
p and q are *processed* distributions (temperature, top-k/top-p/min-p, penalties, logit bias
applied alike); the target arrives as processed float32 logits, -inf where masked, p = softmax.

Batch layout: requests keep their order; request i owns k_i + 1 consecutive rows of the target
rows (p_1..p_{k_i+1}) and k_i consecutive rows of the draft probabilities (q_1..q_{k_i}).

Randomness contract of `rejection_sample` (`rejection_sample_reference` keeps it draw for draw,
so both produce identical tokens for the same keys, and a request's tokens do not depend on what
else is in its batch): each target row has a key (`engine/sampling/counter_rng.py`), and row j of request i
draws ONLY from its own key:
1. draft rows (j <= k_i) take the uniform at column ACCEPT_COLUMN for the acceptance test
   u < p_j(d_j) / q_j(d_j) -- every draft row, also those after the first rejection;
2. the one row that emits a sampled token (recovered or bonus) takes the exponentials E of
   columns [0, vocab): token = argmax(weights / E) with weights the unnormalised residual (or
   p_{k+1} for the bonus).
The acceptance uniforms of all draft rows are one counter computation, the noise of all emitting
rows another: no launch per request or per row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.kernels import argmax_rows
from engine.runtime.device import to_device
from engine.sampling.counter_rng import exponentials, uniforms

# A column past any vocabulary: a draft row's acceptance uniform is never one of the values its
# noise would use if it emits, so the acceptance test and the recovered token stay independent.
ACCEPT_COLUMN = 1 << 40


@dataclass(frozen=True)
class VerifyResult:
    """Per request: the number of accepted drafts and the tokens emitted this step."""

    num_accepted: list[int]
    output_token_ids: list[list[int]]  # accepted drafts + 1 recovered/bonus token

    def __post_init__(self) -> None:
        assert len(self.num_accepted) == len(self.output_token_ids)
        assert all(
            len(ids) == a + 1
            for a, ids in zip(self.num_accepted, self.output_token_ids, strict=True)
        )


def exponential_race(weights: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """argmax(weights / noise) over the last dim: a draw from norm(weights) (weights >= 0, not
    necessarily normalised) when noise ~ Exp(1) i.i.d. Ties go to the lowest id."""
    return argmax_rows(weights / noise)


@dataclass(frozen=True)
class _Layout:
    """Where each request's rows and drafts sit in the flat batch tensors."""

    num_drafts: torch.Tensor  # [num_requests] int64, k_i
    first_rows: torch.Tensor  # [num_requests] int64, row of p_1 in the target rows
    first_drafts: torch.Tensor  # [num_requests] int64, row of q_1 in the draft rows
    draft_rows: torch.Tensor  # [total_drafts] int64, target row of each draft
    draft_ids: torch.Tensor  # [total_drafts] int64, d_j
    is_valid: torch.Tensor  # [num_requests, max_drafts] bool, j < k_i

    @property
    def num_rows(self) -> int:
        return int(self.num_drafts.sum()) + self.num_drafts.shape[0]


def _layout(draft_token_ids: Sequence[Sequence[int]], device: torch.device) -> _Layout:
    """Index tensors of one verify, built on the host from the draft lists, copied once."""
    num_drafts = torch.tensor(
        [len(ids) for ids in draft_token_ids], dtype=torch.int64, device="cpu"
    )
    num_requests = num_drafts.shape[0]
    cu_drafts = torch.cumsum(num_drafts, dim=0) - num_drafts  # [num_requests], exclusive
    first_rows = cu_drafts + torch.arange(num_requests, device="cpu")  # [num_requests]
    # Draft j of request i sits at target row first_rows[i] + j: its flat index plus one bonus
    # row for each request before it.
    request_of_draft = torch.repeat_interleave(torch.arange(num_requests, device="cpu"), num_drafts)
    # [total_drafts]
    draft_rows = torch.arange(request_of_draft.shape[0], device="cpu") + request_of_draft
    draft_ids = torch.tensor(
        [t for ids in draft_token_ids for t in ids], dtype=torch.int64, device="cpu"
    )
    max_drafts = int(num_drafts.max()) if num_requests else 0
    is_valid = torch.arange(max_drafts, device="cpu").unsqueeze(0) < num_drafts.unsqueeze(1)
    return _Layout(
        num_drafts=to_device(num_drafts, device),
        first_rows=to_device(first_rows, device),
        first_drafts=to_device(cu_drafts, device),
        draft_rows=to_device(draft_rows, device),
        draft_ids=to_device(draft_ids, device),
        is_valid=to_device(is_valid, device),  # [num_requests, max_drafts]
    )


def _count_accepted(is_accepted: torch.Tensor, layout: _Layout) -> torch.Tensor:
    """is_accepted [total_drafts] bool -> [num_requests] int64: the accepted prefix lengths."""
    padded = torch.zeros(layout.is_valid.shape, dtype=torch.int64, device=is_accepted.device)
    # Row-major order of the valid cells is the flat draft order; padding (0) ends every prefix.
    padded[layout.is_valid] = is_accepted.to(torch.int64)  # [num_requests, max_drafts]
    return padded.cumprod(dim=1).sum(dim=1)


def verify_by_sampling(
    sampled_token_ids: torch.Tensor, draft_token_ids: Sequence[Sequence[int]]
) -> VerifyResult:
    """Verify drafts without a distribution (one-hot q), and the drafts of greedy requests.

    sampled_token_ids [num_rows] int64 holds the target's own sample x_j at every row, drawn
    exactly as without speculation (the argmax for greedy rows). Accept d_j while d_j == x_j and
    emit x_1..x_{a+1}.

    For a one-hot q (q_j(d_j) = 1) this IS the rejection rule. The acceptance probability
    min(1, p_j(d_j) / 1) = p_j(d_j) = P(x_j = d_j). The residual max(0, p_j - q_j) is p_j
    everywhere except at d_j, where it is max(0, p_j(d_j) - 1) = 0: it is p_j with d_j removed
    and renormalised, which is exactly the law of x_j given x_j != d_j. So emitting x_j at the
    first mismatch samples the recovered token, and x_{k+1} is the bonus drawn from p_{k+1}.
    For greedy rows (x_j = argmax p_j) it keeps drafts while they equal the argmax and emits
    the argmax at the first mismatch: the non-speculative greedy output, token for token.
    """
    layout = _layout(draft_token_ids, sampled_token_ids.device)
    if sampled_token_ids.dim() != 1 or sampled_token_ids.shape[0] != layout.num_rows:
        raise ValueError(
            f"sampled_token_ids must be [{layout.num_rows}], got {tuple(sampled_token_ids.shape)}."
        )
    is_accepted = sampled_token_ids[layout.draft_rows] == layout.draft_ids  # [total_drafts]
    num_accepted = _count_accepted(is_accepted, layout).tolist()
    sampled = sampled_token_ids.tolist()
    output_token_ids = [
        sampled[start : start + a + 1]
        for start, a in zip(layout.first_rows.tolist(), num_accepted, strict=True)
    ]
    return VerifyResult(num_accepted, output_token_ids)


def rejection_sample(
    target_logits: torch.Tensor,
    draft_token_ids: Sequence[Sequence[int]],
    draft_probs: torch.Tensor,
    keys: torch.Tensor,
) -> VerifyResult:
    """Standard speculative sampling (Leviathan et al.; Chen et al.) for drafts with a
    distribution: accept d_j with probability min(1, p_j(d_j) / q_j(d_j)); at the first
    rejection sample the recovered token from norm(max(0, p_j - q_j)); when all are accepted
    sample the bonus from p_{k+1}. The emitted tokens are distributed exactly as the target's.

    target_logits [num_rows, vocab] processed float32 logits (-inf = masked), rows as in the
    module docstring; draft_probs [sum k_i, vocab] float32 q rows; keys [num_rows] int64, the
    key of every target row, used as the module's randomness contract says.
    k_i == 0 is allowed (the request just samples its one row). A draft with q_j(d_j) == 0 or
    p_j(d_j) == 0 is rejected.
    """
    device = target_logits.device
    layout = _layout(draft_token_ids, device)
    _check_inputs(target_logits, draft_token_ids, draft_probs, keys, layout)
    keys = keys.to(device)  # [num_rows]
    probs = target_logits.to(torch.float32).softmax(dim=-1)  # [num_rows, vocab]
    q = draft_probs.to(device=device, dtype=torch.float32)  # [total_drafts, vocab]
    draws = uniforms(keys[layout.draft_rows], 1, ACCEPT_COLUMN)[:, 0]  # [total_drafts]
    p_draft = probs[layout.draft_rows, layout.draft_ids]  # [total_drafts]
    q_draft = q[torch.arange(q.shape[0], device=device), layout.draft_ids]  # [total_drafts]
    # u < p / q accepts with probability min(1, p / q); p == 0 gives 0 and never accepts. A
    # draft with q == 0 could not have been drawn from q: reject it rather than divide by 0.
    is_accepted = (q_draft > 0) & (draws < p_draft / q_draft)  # [total_drafts]
    num_accepted = _count_accepted(is_accepted, layout)  # [num_requests]
    tokens = _sample_emitted(probs, q, num_accepted, layout, keys)  # [num_requests]
    accepted_list = num_accepted.tolist()
    output_token_ids = [
        [*ids[:a], token]
        for ids, a, token in zip(draft_token_ids, accepted_list, tokens.tolist(), strict=True)
    ]
    return VerifyResult(accepted_list, output_token_ids)


def _sample_emitted(
    probs: torch.Tensor,
    q: torch.Tensor,
    num_accepted: torch.Tensor,
    layout: _Layout,
    keys: torch.Tensor,
) -> torch.Tensor:
    """One recovered or bonus token per request -> [num_requests] int64, drawn in one batched
    exponential race over the emitting rows only (keys [num_rows], of every target row)."""
    num_requests, vocab_size = num_accepted.shape[0], probs.shape[1]
    if num_requests == 0:
        return torch.empty(0, dtype=torch.int64, device=probs.device)
    emit_rows = layout.first_rows + num_accepted  # [num_requests]
    p_emit = probs[emit_rows]  # [num_requests, vocab]
    is_bonus = (num_accepted == layout.num_drafts).unsqueeze(1)  # [num_requests, 1]
    if q.shape[0]:
        # A bonus row has no q: index any valid row, then subtract zero, which leaves p exact.
        q_rows = (layout.first_drafts + num_accepted).clamp_max(q.shape[0] - 1)  # [num_requests]
        q_emit = torch.where(is_bonus, 0.0, q[q_rows])  # [num_requests, vocab]
    else:
        q_emit = torch.zeros_like(p_emit)
    residual = (p_emit - q_emit).clamp_min_(0.0)  # [num_requests, vocab], unnormalised
    # An all-zero residual (p == q) has acceptance probability 1 and cannot follow a rejection;
    # fall back to p so that a degenerate input still samples a supported token.
    has_mass = (residual > 0).any(dim=-1, keepdim=True)  # [num_requests, 1]
    weights = torch.where(has_mass, residual, p_emit)  # [num_requests, vocab]
    noise = exponentials(keys[emit_rows], vocab_size)  # [num_requests, vocab]
    return exponential_race(weights, noise)


def _check_inputs(
    target_logits: torch.Tensor,
    draft_token_ids: Sequence[Sequence[int]],
    draft_probs: torch.Tensor,
    keys: torch.Tensor,
    layout: _Layout,
) -> None:
    num_drafts = layout.num_drafts.tolist()
    if target_logits.dim() != 2 or target_logits.shape[0] != layout.num_rows:
        raise ValueError(
            f"target_logits must be [{layout.num_rows}, vocab], got {tuple(target_logits.shape)}."
        )
    expected = (sum(num_drafts), target_logits.shape[1])
    if tuple(draft_probs.shape) != expected:
        raise ValueError(f"draft_probs must be {list(expected)}, got {tuple(draft_probs.shape)}.")
    if tuple(keys.shape) != (layout.num_rows,):
        raise ValueError(f"keys must be [{layout.num_rows}], one per target row.")
    if any(not 0 <= t < expected[1] for ids in draft_token_ids for t in ids):
        raise ValueError("draft token ids must lie in [0, vocab).")
