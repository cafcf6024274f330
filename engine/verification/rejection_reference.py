"""Plain one-request-at-a-time reference for `engine.verification.rejection`, the oracle its tests trust.

Written for clarity, not speed: plain loops over one request's drafts, with the random draws of
the randomness contract in `engine/verification/rejection.py` (the same keys and columns, each row
drawn on its own), so the vectorised version must match it token for token. Only tests use it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.sampling.counter_rng import exponentials, uniforms
from engine.verification.rejection import ACCEPT_COLUMN, exponential_race


def rejection_sample_reference(
    p_logits: torch.Tensor,
    draft_token_ids: Sequence[int],
    q: torch.Tensor,
    keys: Sequence[int],
) -> tuple[int, list[int]]:
    """One request: p_logits [k+1, vocab] processed logits, q [k, vocab] draft probabilities,
    keys[j] for row j (k + 1 of them) -> (num_accepted, accepted drafts + 1 token)."""
    k = len(draft_token_ids)
    assert p_logits.shape[0] == k + 1 and q.shape[0] == k and len(keys) == k + 1
    p = torch.softmax(p_logits.to(torch.float32), dim=-1)  # [k+1, vocab]
    q = q.to(torch.float32)  # [k, vocab]
    vocab_size = p.shape[1]
    # Every draft row draws its acceptance uniform, also the rows after the first rejection.
    accept = [float(uniforms(_key(keys[j]), 1, ACCEPT_COLUMN)) for j in range(k)]

    for j, d in enumerate(draft_token_ids):
        p_d, q_d = p[j, d], q[j, d]
        if q_d > 0 and accept[j] < float(p_d / q_d):
            continue  # accepted with probability min(1, p_d / q_d)
        residual = torch.clamp(p[j] - q[j], min=0.0)  # [vocab], unnormalised
        if not bool((residual > 0).any()):
            residual = p[j]
        noise = exponentials(_key(keys[j]), vocab_size)[0]  # [vocab]
        recovered = int(exponential_race(residual, noise))
        return j, [*draft_token_ids[:j], recovered]

    noise = exponentials(_key(keys[k]), vocab_size)[0]  # [vocab]
    bonus = int(exponential_race(p[k], noise))
    return k, [*draft_token_ids, bonus]


def verify_by_sampling_reference(
    sampled_token_ids: Sequence[int], draft_token_ids: Sequence[int]
) -> tuple[int, list[int]]:
    """One request: the target's own samples x_1..x_{k+1} and drafts d_1..d_k ->
    (num_accepted, x_1..x_{a+1}), accepting while d_j == x_j."""
    assert len(sampled_token_ids) == len(draft_token_ids) + 1
    num_accepted = 0
    while (
        num_accepted < len(draft_token_ids)
        and draft_token_ids[num_accepted] == sampled_token_ids[num_accepted]
    ):
        num_accepted += 1
    return num_accepted, list(sampled_token_ids[: num_accepted + 1])


def _key(key: int) -> torch.Tensor:
    """One row's key as the [1] int64 tensor the counter functions take."""
    return torch.tensor([key], dtype=torch.int64, device="cpu")
