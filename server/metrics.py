"""Prometheus export of the engine's numbers: the one adapter between plain stats and series.

The engine never imports `prometheus_client`. On each scrape the /metrics route reads an
`EngineSnapshot` on the engine thread (`AsyncEngine.call`, between two steps, so the numbers are
consistent) and the per-app `EngineCollector` turns the latest snapshot into series under the
`specserve:` prefix, each labelled with `model_name`. While the engine is loading or dead the
last snapshot read (or none) is exported.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.engine import LLMEngine

PREFIX = "specserve:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True)
class EngineSnapshot:
    """Engine numbers at one instant, read on the engine thread."""

    num_running: int
    num_waiting: int
    num_kv_blocks: int
    num_used_kv_blocks: int
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_pos: tuple[int, ...]
    num_cut_by_stop: int
    num_prediction_accepted: int
    num_prediction_rejected: int
    draft_time_s: float
    verify_time_s: float

    @property
    def kv_cache_usage(self) -> float:
        return self.num_used_kv_blocks / self.num_kv_blocks if self.num_kv_blocks else 0.0


def read_snapshot(engine: LLMEngine) -> EngineSnapshot:
    """Run on the engine thread (through `AsyncEngine.call`)."""
    blocks, stats = engine.block_manager, engine.spec_stats
    return EngineSnapshot(
        num_running=len(engine.scheduler.running),
        num_waiting=len(engine.scheduler.waiting),
        num_kv_blocks=blocks.num_blocks,
        num_used_kv_blocks=blocks.num_used_blocks,
        num_drafts=stats.num_drafts,
        num_draft_tokens=stats.num_draft_tokens,
        num_accepted_tokens=stats.num_accepted_tokens,
        accepted_per_pos=tuple(stats.accepted_per_pos),
        num_cut_by_stop=stats.num_cut_by_stop,
        num_prediction_accepted=stats.num_prediction_accepted,
        num_prediction_rejected=stats.num_prediction_rejected,
        draft_time_s=stats.draft_time,
        verify_time_s=stats.verify_time,
    )


class EngineCollector(Collector):
    """Series from the latest `EngineSnapshot`; `update` replaces it (one per scrape)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.snapshot: EngineSnapshot | None = None

    def update(self, snapshot: EngineSnapshot) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot
        if s is None:
            return
        labels = ["model_name"]
        for name, doc, value in (
            ("num_requests_running", "Sequences in the running batch.", s.num_running),
            ("num_requests_waiting", "Sequences waiting for admission.", s.num_waiting),
            (
                "kv_cache_usage_perc",
                "Fraction of KV-cache blocks in use (0 to 1).",
                s.kv_cache_usage,
            ),
        ):
            gauge = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            gauge.add_metric([self.model_name], value)
            yield gauge
        yield from self._spec_counters(s)

    def _spec_counters(self, s: EngineSnapshot) -> Iterator[Metric]:
        labels = ["model_name"]
        for name, doc, value in (
            ("spec_decode_num_drafts", "Verify steps with at least one draft token.", s.num_drafts),
            ("spec_decode_num_draft_tokens", "Draft tokens verified.", s.num_draft_tokens),
            ("spec_decode_num_accepted_tokens", "Draft tokens accepted.", s.num_accepted_tokens),
            (
                "spec_decode_num_cut_by_stop_tokens",
                "Accepted draft tokens dropped because a stop condition ended the output.",
                s.num_cut_by_stop,
            ),
            (
                "spec_decode_num_prediction_accepted_tokens",
                "Accepted draft tokens that came from a request's `prediction`.",
                s.num_prediction_accepted,
            ),
            (
                "spec_decode_num_prediction_rejected_tokens",
                "Rejected draft tokens that came from a request's `prediction`.",
                s.num_prediction_rejected,
            ),
            ("spec_decode_draft_time_seconds", "Time spent proposing drafts.", s.draft_time_s),
            (
                "spec_decode_verify_time_seconds",
                "Time of target forwards and verification in steps with drafts.",
                s.verify_time_s,
            ),
        ):
            counter = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            counter.add_metric([self.model_name], value)
            yield counter
        per_pos = CounterMetricFamily(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Verify steps that accepted the draft token at each position (1-based).",
            labels=[*labels, "position"],
        )
        for pos, count in enumerate(s.accepted_per_pos, start=1):
            per_pos.add_metric([self.model_name, str(pos)], count)
        yield per_pos


def new_registry(model_name: str) -> tuple[CollectorRegistry, EngineCollector]:
    """A registry of this app's own (never the process-global one) with the engine collector."""
    registry = CollectorRegistry()
    collector = EngineCollector(model_name)
    registry.register(collector)
    return registry, collector


def render(registry: CollectorRegistry) -> bytes:
    """The Prometheus text exposition of every series in `registry`."""
    return generate_latest(registry)
