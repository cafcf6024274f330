"""The tokens one sequence computes in a step (`SeqChunk`), and what their attention reads.

A step is one flattened forward over the chunks of every scheduled sequence back to back: prompt
chunks, decode tokens and draft tokens to verify alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SeqChunk:
    """The tokens of one sequence computed this step, and how many of the last ones need logits
    (0 for a prompt chunk that does not reach the end, 1 to sample, 1 + k to verify k drafts)."""

    token_ids: Sequence[int]
    start: int  # position of token_ids[0]
    block_table: Sequence[int]
    num_logits: int

    def __post_init__(self) -> None:
        assert self.token_ids and 0 <= self.num_logits <= len(self.token_ids)


def attention_reads(num_cached: int, num_query: int) -> int:
    """KV positions the attention of a chunk of num_query tokens after num_cached reads."""
    return num_query * num_cached + num_query * (num_query + 1) // 2
