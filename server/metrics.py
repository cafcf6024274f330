"""Prometheus export of the engine's numbers: the one adapter between plain stats and series.

The engine never imports `prometheus_client`. On each scrape the /metrics route reads an
`EngineSnapshot` on the engine thread (`AsyncEngine.call`, between two steps, so the numbers are
consistent) and the per-app `EngineCollector` turns the latest snapshot into series under the
`specserve:` prefix, each labelled with `model_name`. While the engine is loading or dead the
last snapshot read (or none) is exported. The HTTP layer's own counts (`ServerCounters`) are
exported from the start by a `ServerCollector`. `format_stats_line` turns two snapshots into the
periodic log line.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, fields

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from engine.core.counters import Histogram
from engine.engine import LLMEngine
from engine.speculative_config import SPEC_MODES

PREFIX = "specserve:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Policy decisions exported from the start (at 0), so a dashboard's series exist before traffic.
POLICY_DECISIONS: tuple[tuple[str, str], ...] = (
    ("speculate", "goodput"), ("speculate", "fixed"),
    ("skip", "request_opt_out"), ("skip", "batch_size"), ("skip", "utilization"),
    ("skip", "compute_bound"), ("skip", "low_acceptance"), ("skip", "catch_up"),
    ("skip", "catch_up_cost"), ("skip", "mode_off"), ("skip", "paused"), ("skip", "in_flight"),
)  # fmt: skip
# (series name, EngineSnapshot attribute, help). Counter names leave out `_total`: the
# exposition adds it. The units behind each number: engine.telemetry.serving_metrics.EngineMetrics.
_GAUGES = (
    ("num_requests_running", "num_running", "Sequences in the running batch."),
    ("num_requests_waiting", "num_waiting", "Sequences waiting for admission."),
    ("kv_cache_usage_perc", "kv_cache_usage", "Fraction of KV-cache blocks in use (0 to 1)."),
    ("spec_decode_requests_speculating", "num_requests_speculating",
     "Decoding requests granted draft tokens in the latest step."),
    ("spec_decode_requests_decoding", "num_requests_decoding",
     "Decoding requests in the latest step."),
)  # fmt: skip
_COUNTERS = (
    ("prompt_tokens", "num_prompt_tokens", "Prompt tokens, once per request."),
    ("generation_tokens", "num_generation_tokens", "Output tokens of all sequences."),
    ("num_preemptions", "num_preemptions", "Sequences preempted to free KV blocks."),
    ("prefix_cache_queries", "num_prefix_cache_queries", "Tokens looked up in the prefix cache."),
    ("prefix_cache_hits", "num_prefix_cache_hits", "Tokens found in the prefix cache."),
    ("engine_steps", "num_steps", "Engine steps (target forwards)."),
    ("overlapped_steps", "num_overlapped_steps",
     "Engine steps read back after the next step was launched (overlap scheduling)."),
    ("spec_decode_num_drafts", "num_drafts", "Verify steps with at least one draft token."),
    ("spec_decode_num_draft_tokens", "num_draft_tokens", "Draft tokens verified."),
    ("spec_decode_num_accepted_tokens", "num_accepted_tokens", "Draft tokens accepted."),
    ("spec_decode_num_cut_by_stop_tokens", "num_cut_by_stop",
     "Accepted draft tokens dropped because a stop condition ended the output."),
    ("spec_decode_num_prediction_accepted_tokens", "num_prediction_accepted",
     "Accepted draft tokens that came from a request's `prediction`."),
    ("spec_decode_num_prediction_rejected_tokens", "num_prediction_rejected",
     "Rejected draft tokens that came from a request's `prediction`."),
)  # fmt: skip
_HISTOGRAMS = (
    ("time_to_first_token_seconds", "time_to_first_token",
     "Arrival to the first output token, per sequence."),
    ("inter_token_latency_seconds", "inter_token_latency",
     "Time per output token after the first, amortised over multi-token steps."),
    ("e2e_request_latency_seconds", "e2e_request_latency",
     "Arrival to finish of sequences that stop or reach their length (not aborts)."),
    ("request_queue_time_seconds", "request_queue_time",
     "Arrival to first scheduling, per sequence."),
    ("spec_decode_draft_tokens_per_step", "draft_tokens_per_step",
     "Draft tokens granted per decoding request per step."),
    ("spec_decode_draft_time_seconds", "draft_time",
     "Proposer time per step in which drafts were granted."),
    ("spec_decode_verify_time_seconds", "verify_time",
     "Target forward and verification time per step with drafts."),
)  # fmt: skip


@dataclass(frozen=True)
class HistogramData:
    """A histogram at one instant: (le, cumulative count) pairs ending with +Inf, and the sum."""

    buckets: tuple[tuple[str, int], ...]
    sum: float

    @classmethod
    def of(cls, histogram: Histogram) -> HistogramData:
        return cls(tuple(histogram.cumulative()), histogram.sum)

    @property
    def count(self) -> int:
        return self.buckets[-1][1]


@dataclass(frozen=True)
class EngineSnapshot:
    """Engine numbers at one instant, read on the engine thread. Counters are cumulative."""

    num_running: int
    num_waiting: int
    num_kv_blocks: int
    num_used_kv_blocks: int
    num_prompt_tokens: int
    num_generation_tokens: int
    num_finished: tuple[tuple[str, int], ...]  # (finish reason, sequences)
    num_preemptions: int
    num_prefix_cache_queries: int  # tokens
    num_prefix_cache_hits: int  # tokens
    num_steps: int
    num_overlapped_steps: int
    time_to_first_token: HistogramData
    inter_token_latency: HistogramData
    e2e_request_latency: HistogramData
    request_queue_time: HistogramData
    # Speculation
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_pos: tuple[int, ...]
    num_cut_by_stop: int
    num_prediction_accepted: int
    num_prediction_rejected: int
    by_source: tuple[tuple[str, int, int], ...]  # (draft source, draft tokens, accepted)
    draft_time: HistogramData
    verify_time: HistogramData
    # The policy
    policy_decisions: tuple[tuple[tuple[str, str], int], ...]  # ((decision, reason), count)
    draft_tokens_per_step: HistogramData
    num_requests_speculating: int
    num_requests_decoding: int
    mode_seconds: tuple[tuple[str, float], ...]  # (policy mode, seconds of its steps)
    mode_tokens: tuple[tuple[str, int], ...]  # (policy mode, tokens its steps generated)

    @property
    def kv_cache_usage(self) -> float:
        return self.num_used_kv_blocks / self.num_kv_blocks if self.num_kv_blocks else 0.0


def read_snapshot(engine: LLMEngine) -> EngineSnapshot:
    """Run on the engine thread (through `AsyncEngine.call`)."""
    blocks, scheduler, serving = engine.block_manager, engine.scheduler, engine.metrics
    spec, policy = engine.spec_stats, engine.policy_stats
    return EngineSnapshot(
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        num_kv_blocks=blocks.num_blocks,
        num_used_kv_blocks=blocks.num_used_blocks,
        num_prompt_tokens=serving.num_prompt_tokens,
        num_generation_tokens=serving.num_generation_tokens,
        num_finished=tuple(serving.num_finished.items()),
        num_preemptions=scheduler.num_preemptions_total,
        num_prefix_cache_queries=scheduler.num_prefix_cache_queries,
        num_prefix_cache_hits=scheduler.num_prefix_cache_hits,
        num_steps=serving.num_steps,
        num_overlapped_steps=serving.num_overlapped_steps,
        time_to_first_token=HistogramData.of(serving.time_to_first_token),
        inter_token_latency=HistogramData.of(serving.inter_token_latency),
        e2e_request_latency=HistogramData.of(serving.e2e_request_latency),
        request_queue_time=HistogramData.of(serving.request_queue_time),
        num_drafts=spec.num_drafts,
        num_draft_tokens=spec.num_draft_tokens,
        num_accepted_tokens=spec.num_accepted_tokens,
        accepted_per_pos=tuple(spec.accepted_per_pos),
        num_cut_by_stop=spec.num_cut_by_stop,
        num_prediction_accepted=spec.num_prediction_accepted,
        num_prediction_rejected=spec.num_prediction_rejected,
        by_source=tuple((source, n, a) for source, (n, a) in sorted(spec.by_source.items())),
        draft_time=HistogramData.of(serving.draft_time),
        verify_time=HistogramData.of(serving.verify_time),
        policy_decisions=tuple(policy.decisions.items()),
        draft_tokens_per_step=HistogramData.of(policy.draft_tokens_per_step),
        num_requests_speculating=policy.num_requests_speculating,
        num_requests_decoding=policy.num_requests_decoding,
        mode_seconds=tuple(policy.mode_seconds.items()),
        mode_tokens=tuple(policy.mode_tokens.items()),
    )


@dataclass
class ServerCounters:
    """What the HTTP layer counts (on the event loop), exported as `specserve:<name>_total`."""

    num_stream_stalls: int = 0  # responses cut because the client read nothing for too long


_SERVER_COUNTERS = {
    "num_stream_stalls": (
        "stream_stalls",
        "Responses cut, and their requests aborted, because the client read nothing for "
        "stream_stall_timeout seconds.",
    ),
}


class ServerCollector(Collector):
    """Series from the HTTP layer's `ServerCounters`, at 0 from the start."""

    def __init__(self, model_name: str, counters: ServerCounters) -> None:
        self.model_name = model_name
        self.counters = counters

    def collect(self) -> Iterator[Metric]:
        for f in fields(self.counters):
            name, doc = _SERVER_COUNTERS[f.name]
            counter = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            counter.add_metric([self.model_name], getattr(self.counters, f.name))
            yield counter


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
        yield from self._gauges(s)
        yield from self._counters(s)
        yield from self._labelled_counters(s)
        yield from self._histograms(s)

    def _gauges(self, s: EngineSnapshot) -> Iterator[Metric]:
        for name, attr, doc in _GAUGES:
            gauge = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            gauge.add_metric([self.model_name], getattr(s, attr))
            yield gauge

    def _counters(self, s: EngineSnapshot) -> Iterator[Metric]:
        for name, attr, doc in _COUNTERS:
            counter = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            counter.add_metric([self.model_name], getattr(s, attr))
            yield counter

    def _labelled_counters(self, s: EngineSnapshot) -> Iterator[Metric]:
        yield self._counter(
            "request_success",
            "Finished sequences by finish reason.",
            "finished_reason",
            ((reason,) for reason, _ in s.num_finished),
            (count for _, count in s.num_finished),
        )
        yield self._counter(
            "spec_decode_num_accepted_tokens_per_pos",
            "Verify steps that accepted the draft token at each position (1-based).",
            "position",
            ((str(pos),) for pos in range(1, len(s.accepted_per_pos) + 1)),
            s.accepted_per_pos,
        )
        draft_counts = [(n, a) for _, n, a in s.by_source]  # (draft tokens, accepted)
        for name, doc, column in (
            ("spec_decode_num_draft_tokens_by_method", "Draft tokens verified", 0),
            ("spec_decode_num_accepted_tokens_by_method", "Draft tokens accepted", 1),
        ):
            yield self._counter(
                name,
                f"{doc}, by the draft source that made them (ngram, draft_model, eagle3, "
                "prediction, grammar).",
                "method",
                ((row[0],) for row in s.by_source),
                (counts[column] for counts in draft_counts),
            )
        decisions = dict.fromkeys(POLICY_DECISIONS, 0) | dict(s.policy_decisions)
        yield self._counter(
            "spec_decode_policy_decisions",
            "Per step and decoding request, the policy's decision and its reason.",
            ("decision", "reason"),
            decisions.keys(),
            decisions.values(),
        )
        for name, doc, per_mode in (
            ("spec_decode_mode_seconds", "Seconds", s.mode_seconds),
            ("spec_decode_mode_generation_tokens", "Generation tokens", s.mode_tokens),
        ):
            counts = dict.fromkeys(SPEC_MODES, 0) | dict(per_mode)
            yield self._counter(
                name,
                f"{doc} of engine steps, by the speculation mode they were decided in.",
                "mode",
                ((mode,) for mode in counts),
                counts.values(),
            )

    def _counter(
        self,
        name: str,
        doc: str,
        label_names: str | tuple[str, ...],
        label_values: Iterable[tuple[str, ...]],
        counts: Iterable[float],
    ) -> Metric:
        names = (label_names,) if isinstance(label_names, str) else label_names
        counter = CounterMetricFamily(PREFIX + name, doc, labels=["model_name", *names])
        for values, count in zip(label_values, counts, strict=True):
            counter.add_metric([self.model_name, *values], count)
        return counter

    def _histograms(self, s: EngineSnapshot) -> Iterator[Metric]:
        for name, attr, doc in _HISTOGRAMS:
            data: HistogramData = getattr(s, attr)
            histogram = HistogramMetricFamily(PREFIX + name, doc, labels=["model_name"])
            histogram.add_metric([self.model_name], list(data.buckets), data.sum)
            yield histogram


def format_stats_line(
    previous: EngineSnapshot | None, current: EngineSnapshot, seconds: float
) -> str:
    """The periodic log line: speculation and throughput over the last `seconds` (since the
    engine started when `previous` is None), the queue and the KV cache now."""

    def delta(name: str) -> int:
        return getattr(current, name) - (getattr(previous, name) if previous else 0)

    num_drafts, num_draft_tokens = delta("num_drafts"), delta("num_draft_tokens")
    num_accepted = delta("num_accepted_tokens")
    old_decisions = dict(previous.policy_decisions) if previous else {}
    num_decided = num_speculated = 0
    for key, count in current.policy_decisions:
        num_decided += count - old_decisions.get(key, 0)
        if key[0] == "speculate":
            num_speculated += count - old_decisions.get(key, 0)
    acceptance = f"{num_accepted / num_draft_tokens:.1%}" if num_draft_tokens else "-"
    length = f"{1 + num_accepted / num_drafts:.2f}" if num_drafts else "-"
    share = f"{num_speculated / num_decided:.0%}" if num_decided else "-"
    tokens_per_s = delta("num_generation_tokens") / seconds if seconds > 0 else 0.0
    return (
        f"generation {tokens_per_s:.1f} tokens/s, running {current.num_running}, "
        f"waiting {current.num_waiting}, KV cache {current.kv_cache_usage:.1%}; "
        f"speculation: acceptance rate {acceptance}, mean acceptance length {length}, "
        f"decoding requests speculating {share}"
    )


def new_registry(model_name: str) -> tuple[CollectorRegistry, EngineCollector]:
    """A registry of this app's own (never the process-global one) with the engine collector."""
    registry = CollectorRegistry()
    collector = EngineCollector(model_name)
    registry.register(collector)
    return registry, collector


def render(registry: CollectorRegistry) -> bytes:
    """The Prometheus text exposition of every series in `registry`."""
    return generate_latest(registry)
