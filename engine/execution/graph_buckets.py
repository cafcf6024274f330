"""Which steps a CUDA graph holds: the padded token counts captured for each longest query per
sequence (decode graphs, verify graphs, a draft model's first forward), and the bucket a step
replays (engine/execution/cuda_graphs.py has the why). Pure arithmetic: the memory plan reads
these bounds before any graph exists.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.core.chunks import SeqChunk

MAX_CAPTURE_TOKENS = 512


# The attention backends whose forward can be captured (GraphableBackend), by name: what the
# memory plan reserves a graph pool for before any backend is built.
GRAPHABLE_BACKENDS = ("flash_attn", "triton")


# A draft model's first forward of a step gives a drafting request the tokens the draft has not
# seen: its last token and the bonus after a full accept (2), up to 1 + K + 1 after a step whose
# K drafts another proposer (n-gram) made and the target all accepted. Its graphs take this
# many tokens more per sequence than the target's verify graphs; longer catch-up runs eagerly.
DRAFT_QUERY_MARGIN = 1


def capture_sizes(cap: int, smallest: int = 1) -> tuple[int, ...]:
    """The padded token counts to capture, from `smallest` up to `cap` (always included)."""
    ladder = [1, 2, 4, *range(8, 257, 8), *range(288, cap + 1, 32)]
    sizes = {s for s in ladder if smallest <= s <= cap}
    if cap >= smallest:
        sizes.add(cap)
    return tuple(sorted(sizes))


def verify_query_len(config: EngineConfig) -> int:
    """The longest query one sequence has in a served decode/verify step of the target: 1 + the
    speculative config's num_speculative_tokens (1 without speculation)."""
    spec = config.speculative_config
    return 1 + (spec.num_speculative_tokens if spec is not None else 0)


def draft_max_query_len(num_speculative_tokens: int) -> int:
    """The longest query per sequence a draft model's captured graphs take: its first forward of
    a step after accepted drafts (see DRAFT_QUERY_MARGIN)."""
    return 1 + num_speculative_tokens + DRAFT_QUERY_MARGIN


def graph_sizes(config: EngineConfig, max_query_len: int) -> dict[int, tuple[int, ...]]:
    """max query length -> the padded token counts to capture with it (see the module's
    docstring). Every size stays within the memory plan's captured step: at most
    max_num_seqs * verify_query_len(config) tokens, max_num_batched_tokens and
    MAX_CAPTURE_TOKENS, whatever max_query_len is."""
    limit = min(
        config.max_num_batched_tokens,
        MAX_CAPTURE_TOKENS,
        config.max_num_seqs * verify_query_len(config),
    )
    sizes = {1: capture_sizes(min(config.max_num_seqs, limit))}
    verify = capture_sizes(min(config.max_num_seqs * max_query_len, limit), smallest=2)
    if max_query_len > 1 and verify:
        sizes[max_query_len] = verify
    return sizes


def choose_bucket(
    sizes: Mapping[int, Sequence[int]],
    max_model_len: int,
    chunks: Sequence[SeqChunk],
    any_query_len: bool = False,
) -> Bucket | None:
    """The smallest bucket of `sizes` (max query length -> sorted token counts, shortest query
    first) that holds this step, or None (run it eagerly): every chunk within the longest
    context and the bucket's query length, all tokens within its count. A chunk's num_logits
    does not matter (see the module's docstring). `any_query_len`: the backend's captured
    attention reads each token's own position and request, not a longest query (Triton's), so
    any bucket holds any mix of chunks (decodes beside a prompt chunk) within its count."""
    if not chunks or any(c.start + len(c.token_ids) > max_model_len for c in chunks):
        return None
    num_tokens = sum(len(c.token_ids) for c in chunks)
    if any_query_len:
        fits = [
            Bucket(q, counts[i])
            for q, counts in sorted(sizes.items())
            if (i := bisect.bisect_left(counts, num_tokens)) < len(counts)
        ]
        return min(fits, key=lambda b: b.num_tokens) if fits else None
    longest = max(len(c.token_ids) for c in chunks)
    for max_query_len, counts in sorted(sizes.items()):
        i = bisect.bisect_left(counts, num_tokens)
        if longest <= max_query_len and i < len(counts):
            return Bucket(max_query_len, counts[i])
    return None


@dataclass(frozen=True)
class Bucket:
    """One captured shape: padded token count and the longest query a sequence may have."""

    max_query_len: int
    num_tokens: int
