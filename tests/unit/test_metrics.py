"""Engine metrics: the histogram, per-token latency bookkeeping, exact counts after a known
workload on a tiny model (with and without n-gram speculation), the Prometheus series and the
periodic log line built from them."""

from __future__ import annotations

import copy

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine import LLM, SamplingParams
from engine.core.counters import Histogram
from engine.core.request import Request
from engine.engine import LLMEngine
from engine.outputs import OutputAccumulator, RequestOutput
from engine.telemetry.serving_metrics import EngineMetrics
from server.metrics import (
    EngineCollector,
    format_stats_line,
    new_registry,
    read_snapshot,
    render,
)
from tests.conftest import TINY_VOCAB, ngram_llm

# ----------------------------------------------------------------------------- plain stats


def test_histogram_buckets_are_upper_inclusive_and_cumulative() -> None:
    h = Histogram([0.1, 1.0, 10.0])
    for value in (0.05, 0.1, 0.5, 1.0, 3.0, 50.0):
        h.observe(value)
    h.observe(2.0, count=3)
    assert h.counts == [2, 2, 4, 1]
    assert h.count == 9
    assert h.sum == pytest.approx(0.05 + 0.1 + 0.5 + 1.0 + 3.0 + 50.0 + 6.0)
    assert h.cumulative() == [("0.1", 2), ("1.0", 4), ("10.0", 8), ("+Inf", 9)]
    with pytest.raises(ValueError):
        Histogram([1.0, 1.0])
    with pytest.raises(ValueError):
        Histogram([2.0, 1.0])


def _request(arrival: float) -> Request:
    return Request("r#0", [1, 2, 3], SamplingParams(max_tokens=8), 8, arrival_time=arrival)


def test_inter_token_latency_is_amortised_over_a_multi_token_step() -> None:
    metrics, request = EngineMetrics(), _request(arrival=10.0)
    metrics.record_scheduled(request, 10.25, is_first_of_group=True)
    metrics.record_tokens(request, 1, 10.5)  # the first token: TTFT 0.5, no ITL sample
    metrics.record_tokens(request, 3, 11.25)  # 3 tokens 0.75 s later: 3 samples of 0.25
    metrics.record_tokens(request, 0, 12.0)  # nothing appended: nothing recorded
    metrics.record_tokens(request, 1, 11.75)
    assert metrics.num_prompt_tokens == 3 and metrics.num_generation_tokens == 5
    assert metrics.request_queue_time.count == 1
    assert metrics.request_queue_time.sum == pytest.approx(0.25)
    assert metrics.time_to_first_token.count == 1
    assert metrics.time_to_first_token.sum == pytest.approx(0.5)
    itl = metrics.inter_token_latency
    assert itl.count == 4 and itl.sum == pytest.approx(1.25)
    buckets = dict(itl.cumulative())  # 0.25 three times, then 0.5 once
    assert (buckets["0.2"], buckets["0.25"], buckets["0.4"], buckets["0.5"]) == (0, 3, 3, 4)
    assert (request.first_token_time, request.last_token_time) == (10.5, 11.75)
    metrics.record_finished(request, "length", 12.0)
    metrics.record_finished(_request(arrival=11.0), "abort", 12.0)
    assert metrics.num_finished == {"stop": 0, "length": 1, "abort": 1}
    assert metrics.e2e_request_latency.count == 1  # aborts have no end-to-end sample
    assert metrics.e2e_request_latency.sum == pytest.approx(2.0)


# ----------------------------------------------------------------------------- a real engine


def _drain(
    engine: LLMEngine,
    finals: dict[str, RequestOutput],
    whole: OutputAccumulator | None = None,  # the one that took the requests' earlier outputs
    limit: int = 500,
) -> None:
    whole = OutputAccumulator() if whole is None else whole
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            return
        for output in whole.add_step(engine.step()):
            finals[output.request_id] = output
    raise AssertionError("the workload did not finish")


def _sequences(engine: LLMEngine, *request_ids: str) -> list[Request]:
    return [r for request_id in request_ids for r in engine._groups[request_id].requests]


def test_counts_after_a_known_workload(tiny_llama) -> None:
    llm = LLM(
        str(tiny_llama),
        dtype="float32",
        block_size=4,
        num_kv_blocks=128,
        max_model_len=256,
        max_num_seqs=3,  # some sequences wait: queue time is real
        max_num_batched_tokens=16,  # the 9-token prompt arrives in two chunks with others
    )
    engine = llm.engine
    greedy = dict(temperature=0, ignore_eos=True)
    engine.add_request("a", list(range(10, 15)), SamplingParams(max_tokens=6, **greedy))
    engine.add_request("b", list(range(20, 27)), SamplingParams(max_tokens=4, n=2, **greedy))
    engine.add_request("c", list(range(30, 39)), SamplingParams(max_tokens=60, **greedy))
    # Every token is a stop token: one output token, finish reason "stop".
    stop_all = SamplingParams(max_tokens=5, stop_token_ids=list(range(TINY_VOCAB)), **greedy)
    engine.add_request("s", [40, 41, 42, 43], stop_all)
    engine.add_request("q", [50, 51, 52], SamplingParams(max_tokens=5, **greedy))
    sequences = _sequences(engine, "a", "b", "c", "s")
    assert engine.abort("q")  # aborted before it was ever scheduled: no prompt tokens counted

    finals: dict[str, RequestOutput] = {}
    whole = OutputAccumulator()
    (c,) = engine._groups["c"].requests
    for _ in range(200):
        for output in whole.add_step(engine.step()):
            finals[output.request_id] = output
        if c.num_output_tokens >= 3:
            break
    num_c_tokens = c.num_output_tokens
    assert engine.abort("c")  # in the middle of decoding
    _drain(engine, finals, whole)

    m = engine.metrics
    assert m.num_prompt_tokens == 5 + 7 + 9 + 4  # b's two sequences share one prompt
    completions = [o for key in ("a", "b", "s") for o in finals[key].outputs]
    assert [len(o.token_ids) for o in completions] == [6, 4, 4, 1]
    assert [o.finish_reason for o in completions] == ["length"] * 3 + ["stop"]
    assert m.num_generation_tokens == 6 + 4 + 4 + 1 + num_c_tokens
    assert m.num_finished == {"stop": 1, "length": 3, "abort": 2}
    num_seqs = len(sequences)  # a, b#0, b#1, c, s: each got a first token and was scheduled
    assert m.time_to_first_token.count == m.request_queue_time.count == num_seqs
    assert m.inter_token_latency.count == m.num_generation_tokens - num_seqs
    assert m.e2e_request_latency.count == 4  # stop + length, not the aborts
    # The histograms hold exactly the times stamped on the sequences.
    assert m.time_to_first_token.sum == pytest.approx(
        sum(r.first_token_time - r.arrival_time for r in sequences)
    )
    assert m.inter_token_latency.sum == pytest.approx(
        sum(r.last_token_time - r.first_token_time for r in sequences)
    )
    assert m.request_queue_time.sum == pytest.approx(
        sum(r.first_scheduled_time - r.arrival_time for r in sequences)
    )
    for r in sequences:
        assert r.arrival_time <= r.first_scheduled_time <= r.first_token_time <= r.last_token_time
    assert m.draft_time.count == m.verify_time.count == 0  # no speculation configured


def test_speculation_counts_reconcile(tiny_llama) -> None:
    llm = ngram_llm(tiny_llama)
    engine = llm.engine
    repetitive = [7, 8, 9, 10, 11] * 6
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    engine.add_request("one", repetitive, params)
    finals: dict[str, RequestOutput] = {}
    _drain(engine, finals)
    spec, m = engine.spec_stats, engine.metrics
    assert spec.num_drafts > 0 and spec.num_accepted_tokens > 0
    assert spec.num_accepted_tokens == sum(spec.accepted_per_pos)
    assert spec.num_drafts == sum(spec.acceptance_histogram)
    assert spec.num_accepted_tokens == sum(a * n for a, n in enumerate(spec.acceptance_histogram))
    # One sequence: every verify step verified exactly one draft; drafts were granted in them.
    assert m.verify_time.count == spec.num_drafts
    assert m.draft_time.count >= spec.num_drafts
    # Multi-token steps: still one latency sample per token after the first.
    (completion,) = finals["one"].outputs
    assert m.num_generation_tokens == len(completion.token_ids) == 40
    assert m.inter_token_latency.count == 40 - 1
    counted = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_cut_by_stop")
    for name in (*counted, "accepted_per_pos", "acceptance_histogram"):
        # The only request holds every engine count.
        assert getattr(completion.spec_stats, name) == getattr(spec, name), name

    # Several requests: their own counters add up to the engine's.
    before = copy.deepcopy(spec)
    engine.add_request("two", repetitive[3:], SamplingParams(max_tokens=30, n=2, **_greedy()))
    engine.add_request("three", [3, 4] * 10, SamplingParams(max_tokens=25, **_greedy()))
    _drain(engine, finals)
    per_request = [o.spec_stats for key in ("two", "three") for o in finals[key].outputs]
    for name in counted:
        total = getattr(spec, name) - getattr(before, name)
        assert total == sum(getattr(s, name) for s in per_request), name
    for pos, count in enumerate(spec.accepted_per_pos):
        old = before.accepted_per_pos[pos] if pos < len(before.accepted_per_pos) else 0
        assert count - old == sum(
            s.accepted_per_pos[pos] for s in per_request if pos < len(s.accepted_per_pos)
        )
    assert m.num_generation_tokens == 40 + 30 + 30 + 25
    assert m.inter_token_latency.count == m.num_generation_tokens - 4


def _greedy() -> dict:
    return dict(temperature=0, ignore_eos=True)


# ----------------------------------------------------------------------------- the adapter


def test_series_and_log_line_follow_the_engine(tiny_llama) -> None:
    llm = ngram_llm(tiny_llama)
    engine = llm.engine
    first = read_snapshot(engine)
    engine.add_request("r", [7, 8, 9, 10, 11] * 6, SamplingParams(max_tokens=20, **_greedy()))
    _drain(engine, {})
    snapshot = read_snapshot(engine)
    registry, collector = new_registry("tiny")
    collector.update(snapshot)
    families = {f.name: f for f in text_string_to_metric_families(render(registry).decode())}

    def value(name: str, suffix: str = "", **labels: str) -> float:
        family = families[f"specserve:{name}"]
        want = {"model_name": "tiny", **labels}
        matches = [s.value for s in family.samples if s.name.endswith(suffix) and s.labels == want]
        assert len(matches) == 1, (name, suffix, labels)
        return matches[0]

    spec = engine.spec_stats
    assert value("prompt_tokens", "_total") == 30
    assert value("generation_tokens", "_total") == 20
    assert value("request_success", "_total", finished_reason="length") == 1
    assert value("request_success", "_total", finished_reason="abort") == 0
    assert value("spec_decode_num_drafts", "_total") == spec.num_drafts
    assert value("spec_decode_num_accepted_tokens", "_total") == spec.num_accepted_tokens
    per_pos = [
        value("spec_decode_num_accepted_tokens_per_pos", "_total", position=str(p))
        for p in range(1, len(spec.accepted_per_pos) + 1)
    ]
    assert sum(per_pos) == spec.num_accepted_tokens
    assert value("time_to_first_token_seconds", "_count") == 1
    assert value("inter_token_latency_seconds", "_count") == 19
    assert value("inter_token_latency_seconds", "_bucket", le="+Inf") == 19
    assert value("spec_decode_verify_time_seconds", "_count") == spec.num_drafts
    assert value("spec_decode_verify_time_seconds", "_sum") == pytest.approx(
        engine.metrics.verify_time.sum
    )
    assert value("spec_decode_policy_decisions", "_total", decision="skip", reason="mode_off") == 0
    # Every step ran in mode always: its seconds and tokens are there, the other modes at 0.
    policy = engine.policy_stats
    assert value("spec_decode_mode_generation_tokens", "_total", mode="always") == 20
    assert value("spec_decode_mode_seconds", "_total", mode="always") == pytest.approx(
        policy.mode_seconds["always"]
    )
    assert policy.mode_seconds["always"] > 0
    for mode in ("off", "auto"):
        assert value("spec_decode_mode_generation_tokens", "_total", mode=mode) == 0
        assert value("spec_decode_mode_seconds", "_total", mode=mode) == 0
    assert value("num_requests_running") == 0 and value("kv_cache_usage_perc") == 0

    line = format_stats_line(first, snapshot, seconds=2.0)
    rate = spec.num_accepted_tokens / spec.num_draft_tokens
    assert "generation 10.0 tokens/s" in line
    assert f"acceptance rate {rate:.1%}" in line
    assert f"mean acceptance length {1 + spec.num_accepted_tokens / spec.num_drafts:.2f}" in line
    assert "running 0, waiting 0, KV cache 0.0%" in line
    # Nothing happened since: no rates to show.
    idle = format_stats_line(snapshot, snapshot, seconds=5.0)
    assert "generation 0.0 tokens/s" in idle and "acceptance rate -" in idle


def test_collector_exports_nothing_before_a_snapshot() -> None:
    registry, collector = new_registry("tiny")
    assert isinstance(collector, EngineCollector)
    assert "specserve:" not in render(registry).decode()
