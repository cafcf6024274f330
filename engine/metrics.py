"""Plain stats objects the engine fills and an exporter reads (the engine never imports
prometheus_client): cumulative counters and fixed-bucket histograms."""

from __future__ import annotations

import bisect
from collections.abc import Sequence


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
