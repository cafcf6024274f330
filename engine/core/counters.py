"""Cumulative counters, plain data an exporter reads (the engine never imports
prometheus_client): fixed-bucket histograms, and the speculation and policy counters that add
up each step's StepStats (the engine's, and each request's own SpecStats).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.core.stats import StepStats


class Histogram:
    """A cumulative histogram over fixed upper bounds (Prometheus `le` buckets, +Inf implied).

    counts[i] holds observations <= bounds[i] and > bounds[i-1] (not cumulative); the last
    entry counts those above every bound."""

    def __init__(self, bounds: Sequence[float]) -> None:
        if list(bounds) != sorted(set(bounds)):
            raise ValueError(f"histogram bounds must be strictly increasing, got {bounds}")
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += count
        self.sum += value * count

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, int]]:
        """(le, cumulative count) pairs ending with +Inf, as Prometheus exposes buckets."""
        out, total = [], 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            total += n
            out.append(("+Inf" if bound == float("inf") else repr(bound), total))
        return out


@dataclass
class SpecStats:
    """Speculation counters, cumulative for the engine or for one request.

    "Accepted" counts drafts kept (the recovered or bonus token excluded); a draft token accepted
    but cut because a stop condition ended the output before it counts in num_cut_by_stop.
    """

    num_drafts: int = 0  # verify steps with at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [i]: steps accepting position i+1
    acceptance_histogram: list[int] = field(default_factory=list)  # [a]: steps accepting exactly a
    num_cut_by_stop: int = 0
    num_prediction_accepted: int = 0
    num_prediction_rejected: int = 0
    # Per draft source (ngram, draft_model, eagle3, prediction, grammar): [draft tokens, accepted].
    by_source: dict[str, list[int]] = field(default_factory=dict)
    draft_time: float = 0.0  # seconds spent proposing
    verify_time: float = 0.0  # seconds of target forwards + verification in steps with drafts

    def observe(self, step: StepStats) -> None:
        """Count a step's verified drafts (not its shadows) and its times."""
        for v in step.verifies:
            if not v.is_shadow:
                self.record(v.num_draft_tokens, v.num_accepted, v.source, v.num_cut)
        if any(d.num_draft_tokens for d in step.decisions):
            self.draft_time += step.draft_seconds
        if step.has_drafts:
            self.verify_time += step.forward_seconds

    def record(
        self, num_draft_tokens: int, num_accepted: int, source: str, num_cut: int = 0
    ) -> None:
        if num_draft_tokens == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_draft_tokens:
            self.accepted_per_pos.extend([0] * (num_draft_tokens - len(self.accepted_per_pos)))
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1
        if len(self.acceptance_histogram) <= num_accepted:
            self.acceptance_histogram.extend(
                [0] * (num_accepted + 1 - len(self.acceptance_histogram))
            )
        self.acceptance_histogram[num_accepted] += 1
        self.num_cut_by_stop += num_cut
        counts = self.by_source.setdefault(source, [0, 0])
        counts[0] += num_draft_tokens
        counts[1] += num_accepted
        if source == "prediction":
            self.num_prediction_accepted += num_accepted
            self.num_prediction_rejected += num_draft_tokens - num_accepted

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verify step: accepted drafts + the recovered or bonus token."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


# k per request per step: the buckets of spec_decode_draft_tokens_per_step (upper bounds).
DRAFT_TOKENS_BUCKETS: tuple[float, ...] = (0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16)


@dataclass
class PolicyStats:
    """What the speculation policy decided, cumulative for the engine.

    Each step, every decoding request with a draft source gets one decision: "speculate"
    (k > 0) with a reason of SPECULATE_REASONS, or "skip" (k = 0) with one of SKIP_REASONS;
    the skips no Decision was built for (mode off, paused lookups) come counted (StepStats.skipped).
    Every step also counts, under the mode it was decided in, its seconds and the tokens it
    generated: what each mode earns while it runs, when an operator switches modes on a live
    server (bench/policy/run.py compares modes that way, slice by slice under one load).
    """

    decisions: dict[tuple[str, str], int] = field(default_factory=dict)  # (decision, reason)
    draft_tokens_per_step: Histogram = field(
        default_factory=lambda: Histogram(DRAFT_TOKENS_BUCKETS)
    )
    num_requests_speculating: int = 0  # decoding requests granted k > 0 in the latest step
    num_requests_decoding: int = 0  # decoding requests in the latest step
    mode_seconds: dict[str, float] = field(default_factory=dict)  # mode -> seconds of its steps
    mode_tokens: dict[str, int] = field(default_factory=dict)  # mode -> tokens its steps made

    def observe(self, step: StepStats) -> None:
        if step.num_tokens:
            self.mode_seconds[step.mode] = self.mode_seconds.get(step.mode, 0.0) + step.seconds
            self.mode_tokens[step.mode] = self.mode_tokens.get(step.mode, 0) + step.num_generated
        for d in step.decisions:
            key = (d.decision, d.reason)
            self.decisions[key] = self.decisions.get(key, 0) + 1
            self.draft_tokens_per_step.observe(d.num_draft_tokens)
        num_skipped = 0
        for reason, count in step.skipped:
            self.decisions[("skip", reason)] = self.decisions.get(("skip", reason), 0) + count
            self.draft_tokens_per_step.observe(0, count)
            num_skipped += count
        if step.decisions or step.num_tokens:
            self.num_requests_decoding = len(step.decisions) + num_skipped
            self.num_requests_speculating = sum(1 for d in step.decisions if d.num_draft_tokens)
