"""Draft tokens: what a source offers a decoding request before the scheduler runs
(`DraftOffer`), and the drafts a step verifies (`Draft`).

Drafts without a distribution (n-gram lookup, predicted outputs, grammar-forced text, a greedy
draft model) are verified as one-hot q.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The most tokens a model drafter catches up on for one request in one forward: the policy's
# per-step chunk (engine/policy/costs.py) stays within it, and the draft model holds every
# forward to it (engine/drafters/draft_model.py).
MAX_CATCH_UP_CHUNK = 256


@dataclass(frozen=True)
class Draft:
    """Draft tokens for one request and one step."""

    token_ids: tuple[int, ...]  # d_1 .. d_k, k >= 1
    source: str  # the proposer's name, for stats
    probs: torch.Tensor | None = None  # [k, vocab_size] float32 processed q_j; None = one-hot

    def __post_init__(self) -> None:
        assert self.token_ids, "a draft has at least one token"
        assert self.probs is None or self.probs.shape[0] == len(self.token_ids)


@dataclass(frozen=True)
class DraftOffer:
    """What one decoding request could draft this step: its source, the most tokens the source
    can fill, the tokens a draft model must first catch up on, and a lookup's draft."""

    source: str
    max_tokens: int
    num_catch_up: int = 0
    draft: Draft | None = None
