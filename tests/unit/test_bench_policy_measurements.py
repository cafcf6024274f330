"""bench/policy/measurements.py and counters.py: percentiles, inter-token latency, SSE and
Prometheus parsing, the policy's decisions between two scrapes and a level's aggregation."""

from __future__ import annotations

import random

import numpy as np
import pytest

from bench.policy import counters
from bench.policy import measurements as M
from tests.unit.bench_policy_fakes import METRICS, chunk


def test_percentile_matches_numpy():
    rng = random.Random(0)
    for n in (1, 2, 7, 50):
        values = [rng.uniform(0, 10) for _ in range(n)]
        for q in (0, 1, 50, 90, 99, 100):
            assert M.percentile(values, q) == pytest.approx(np.percentile(values, q))
    assert M.percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)
    assert M.percentile([], 50) is None
    with pytest.raises(ValueError):
        M.percentile([1.0], 101)


def test_amortized_itl_spreads_each_burst_over_its_tokens():
    # bursts: [1.0], [1.1, 1.1005, 1.101] (one verify step), [1.3]
    times = [1.0, 1.1, 1.1005, 1.101, 1.3]
    itl = M.amortized_itl(times, burst_gap=0.002)
    assert itl == pytest.approx([0.1 / 3] * 3 + [0.2])
    assert sum(itl) == pytest.approx(1.3 - 1.0)
    # a smaller burst gap splits the step: each arrival is its own burst
    assert M.amortized_itl(times, burst_gap=0.0001) == pytest.approx([0.1, 0.0005, 0.0005, 0.199])
    assert M.amortized_itl([0.5], 0.001) == []
    assert M.amortized_itl([], 0.001) == []


def test_parse_sse_line():
    assert M.parse_sse_line('data: {"a": 1}') == {"a": 1}
    assert M.parse_sse_line("data:[DONE]") == "[DONE]"
    assert M.parse_sse_line("") is None
    assert M.parse_sse_line(": keep-alive") is None
    assert M.parse_sse_line("event: message") is None
    with pytest.raises(M.StreamError):
        M.parse_sse_line("data: [1, 2]")


def test_chat_stream_reader_times_content_chunks_and_reads_usage():
    reader = M.ChatStreamReader(sent_at=10.0)
    lines = [
        (chunk(role="assistant", content=""), 10.2),  # role chunk: no token
        ("", 10.2),
        (chunk(content="def"), 10.25),
        (chunk(content=" f"), 10.40),
        (chunk(finish="stop"), 10.41),
        (chunk(usage={"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}), 10.41),
        ("data: [DONE]", 10.42),
    ]
    for line, now in lines:
        reader.feed(line, now)
    result = reader.result(prompt_index=5, now=10.5)
    assert reader.is_done
    assert result.token_times == pytest.approx((0.25, 0.40))
    assert result.ttft == pytest.approx(0.25)
    assert result.num_completion_tokens == 3  # usage wins over the 2 content chunks
    assert reader.text == "def f"  # the content, for bench/policy/humaneval.py to execute
    assert result.latency == pytest.approx(0.5) and result.prompt_index == 5
    no_usage = M.ChatStreamReader(0.0)
    no_usage.feed(chunk(content="x"), 1.0)
    assert no_usage.result(0, 2.0).num_completion_tokens == 1
    with pytest.raises(M.StreamError, match="boom"):
        no_usage.feed('data: {"error": {"message": "boom"}}', 2.0)


def test_prometheus_decisions_and_speculating_share():
    series = counters.parse_prometheus(METRICS)
    assert series["specserve:num_requests_running"] == [({"model_name": "m"}, 3.0)]
    assert series["process_start_time_seconds"] == [({}, 1.7e9)]
    assert len(series[counters.DECISIONS]) == 4
    after = counters.decision_counts(series)
    assert after == {"speculate": 8.0, "skip": 6.0}
    before = {"speculate": 2.0, "skip": 2.0}
    assert counters.speculating_share(before, after) == pytest.approx(6 / 10)
    assert counters.speculating_share({}, after) == pytest.approx(8 / 14)
    assert counters.speculating_share(after, after) is None  # nothing decided in between
    assert counters.decision_counts(counters.parse_prometheus("up 1\n")) == {}
    assert counters.speculating_share({}, {}) is None  # server without the counters


def test_summarize_level_counts_tokens_inside_the_window_and_skips_errors():
    # window (10.0, 12.0) on the bench's clock; token times are relative to sent_at
    results = [
        M.RequestResult(0, (0.1, 0.2, 0.3), 3, 0.3, sent_at=10.0),  # all inside
        M.RequestResult(1, (0.3, 0.5), 2, 0.5, sent_at=10.0),  # all inside
        M.RequestResult(2, (0.9,), 1, 1.0, error="HTTP 503", sent_at=10.0),
        # sent before the window: its first token (and TTFT) falls outside it
        M.RequestResult(3, (0.5, 1.2), 2, 1.2, sent_at=9.0),
        # cut off at the end: its tokens inside count, the one after does not
        M.RequestResult(4, (0.2, 0.4, 9.0), 3, 9.0, sent_at=11.5, cancelled=True),
    ]
    level = M.summarize_level("auto", "mixed", 2, results, (10.0, 12.0), 0.25, burst_gap=0.001)
    assert level.num_requests == 3 and level.num_errors == 1 and level.num_cancelled == 1
    assert level.num_completion_tokens == 3 + 2 + 1 + 2
    assert level.wall_time == pytest.approx(2.0)
    assert level.tokens_per_s == pytest.approx(8 / 2.0)
    # TTFTs of requests whose first token arrived inside: 0.1, 0.3, 0.2
    assert level.ttft_p50 == pytest.approx(0.2)
    assert level.ttft_p99 == pytest.approx(0.1 + 0.2 * 0.99)
    # ITLs inside: 0.1, 0.1 | 0.2 | (one token) | 0.2
    assert level.itl_p50 == pytest.approx(0.15)
    assert level.speculating_share == 0.25
    empty = M.summarize_level("off", "mixed", 1, [], (0.0, 1.0), None, 0.001)
    assert empty.tokens_per_s == 0.0 and empty.ttft_p50 is None
