"""Plain one-request-at-a-time reference for `engine.speculation.rejection`, the oracle its tests trust.

Written for clarity, not speed: plain loops over one request's drafts, with the random draws of
the randomness contract in `engine/speculation/rejection.py` (same generators, same order), so the
vectorised version must match it token for token. Only tests use it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.speculation.rejection import exponential_noise, exponential_race


def rejection_sample_reference(
    p_logits: torch.Tensor,
    draft_token_ids: Sequence[int],
    q: torch.Tensor,
    generators: Sequence[torch.Generator],
) -> tuple[int, list[int]]:
    """One request: p_logits [k+1, vocab] processed logits, q [k, vocab] draft probabilities,
    generators[j] for row j (k + 1 of them) -> (num_accepted, accepted drafts + 1 token)."""
    k = len(draft_token_ids)
    assert p_logits.shape[0] == k + 1 and q.shape[0] == k and len(generators) == k + 1
    p = torch.softmax(p_logits.to(torch.float32), dim=-1)  # [k+1, vocab]
    q = q.to(torch.float32)  # [k, vocab]
    vocab_size = p.shape[1]
    # Every draft row draws its acceptance uniform, also the rows after the first rejection.
    uniforms = [
        torch.rand(1, generator=generators[j], device=generators[j].device) for j in range(k)
    ]

    for j, d in enumerate(draft_token_ids):
        p_d, q_d = p[j, d], q[j, d]
        if q_d > 0 and bool(uniforms[j] < p_d / q_d):
            continue  # accepted with probability min(1, p_d / q_d)
        residual = torch.clamp(p[j] - q[j], min=0.0)  # [vocab], unnormalised
        if not bool((residual > 0).any()):
            residual = p[j]
        noise = exponential_noise(vocab_size, generators[j])  # [vocab]
        recovered = int(exponential_race(residual, noise))
        return j, [*draft_token_ids[:j], recovered]

    noise = exponential_noise(vocab_size, generators[k])  # [vocab]
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
