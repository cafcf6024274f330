"""bench/policy.py's pure parts (bench/policy_report.py's included): percentiles, inter-token
latency, SSE and Prometheus parsing, level aggregation, the report's comparisons, the per-mode
server config and one streamed request against a mock transport."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import numpy as np
import pytest

from tests.unit.bench_scripts import load_bench_script

P, W, PR = load_bench_script("policy.py", "policy_workload", "policy_report")


def _level(mode, c, tps, workload="mixed", share=None) -> W.LevelResult:
    return W.LevelResult(mode, workload, c, 4, 0, 100, 1.0, tps, 0.1, 0.2, 0.01, 0.02, share)


def test_percentile_matches_numpy():
    rng = random.Random(0)
    for n in (1, 2, 7, 50):
        values = [rng.uniform(0, 10) for _ in range(n)]
        for q in (0, 1, 50, 90, 99, 100):
            assert W.percentile(values, q) == pytest.approx(np.percentile(values, q))
    assert W.percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)
    assert W.percentile([], 50) is None
    with pytest.raises(ValueError):
        W.percentile([1.0], 101)


def test_amortized_itl_spreads_each_burst_over_its_tokens():
    # bursts: [1.0], [1.1, 1.1005, 1.101] (one verify step), [1.3]
    times = [1.0, 1.1, 1.1005, 1.101, 1.3]
    itl = W.amortized_itl(times, burst_gap=0.002)
    assert itl == pytest.approx([0.1 / 3] * 3 + [0.2])
    assert sum(itl) == pytest.approx(1.3 - 1.0)
    # a smaller burst gap splits the step: each arrival is its own burst
    assert W.amortized_itl(times, burst_gap=0.0001) == pytest.approx([0.1, 0.0005, 0.0005, 0.199])
    assert W.amortized_itl([0.5], 0.001) == []
    assert W.amortized_itl([], 0.001) == []


def test_parse_sse_line():
    assert W.parse_sse_line('data: {"a": 1}') == {"a": 1}
    assert W.parse_sse_line("data:[DONE]") == "[DONE]"
    assert W.parse_sse_line("") is None
    assert W.parse_sse_line(": keep-alive") is None
    assert W.parse_sse_line("event: message") is None
    with pytest.raises(W.StreamError):
        W.parse_sse_line("data: [1, 2]")


def _chunk(content=None, usage=None, role=None, finish=None) -> str:
    delta = {k: v for k, v in (("role", role), ("content", content)) if v is not None}
    choices = [] if usage else [{"index": 0, "delta": delta, "finish_reason": finish}]
    return "data: " + json.dumps({"choices": choices, "usage": usage})


def test_chat_stream_reader_times_content_chunks_and_reads_usage():
    reader = W.ChatStreamReader(sent_at=10.0)
    lines = [
        (_chunk(role="assistant", content=""), 10.2),  # role chunk: no token
        ("", 10.2),
        (_chunk(content="def"), 10.25),
        (_chunk(content=" f"), 10.40),
        (_chunk(finish="stop"), 10.41),
        (_chunk(usage={"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}), 10.41),
        ("data: [DONE]", 10.42),
    ]
    for line, now in lines:
        reader.feed(line, now)
    result = reader.result(prompt_index=5, now=10.5)
    assert reader.is_done
    assert result.token_times == pytest.approx((0.25, 0.40))
    assert result.ttft == pytest.approx(0.25)
    assert result.num_completion_tokens == 3  # usage wins over the 2 content chunks
    assert result.latency == pytest.approx(0.5) and result.prompt_index == 5
    no_usage = W.ChatStreamReader(0.0)
    no_usage.feed(_chunk(content="x"), 1.0)
    assert no_usage.result(0, 2.0).num_completion_tokens == 1
    with pytest.raises(W.StreamError, match="boom"):
        no_usage.feed('data: {"error": {"message": "boom"}}', 2.0)


METRICS = """# HELP specserve:spec_decode_policy_decisions_total decisions
# TYPE specserve:spec_decode_policy_decisions_total counter
specserve:spec_decode_policy_decisions_total{decision="speculate",model_name="m",reason="goodput"} 7.0
specserve:spec_decode_policy_decisions_total{decision="speculate",model_name="m",reason="fixed"} 1.0
specserve:spec_decode_policy_decisions_total{decision="skip",model_name="m\\"x",reason="compute_bound"} 4.0
specserve:spec_decode_policy_decisions_total{decision="skip",model_name="m",reason="mode_off"} 2.0
specserve:num_requests_running{model_name="m"} 3.0
process_start_time_seconds 1.7e9
"""


def test_prometheus_decisions_and_speculating_share():
    series = W.parse_prometheus(METRICS)
    assert series["specserve:num_requests_running"] == [({"model_name": "m"}, 3.0)]
    assert series["process_start_time_seconds"] == [({}, 1.7e9)]
    assert len(series[W.DECISIONS]) == 4
    after = W.decision_counts(series)
    assert after == {"speculate": 8.0, "skip": 6.0}
    before = {"speculate": 2.0, "skip": 2.0}
    assert W.speculating_share(before, after) == pytest.approx(6 / 10)
    assert W.speculating_share({}, after) == pytest.approx(8 / 14)
    assert W.speculating_share(after, after) is None  # nothing decided in between
    assert W.decision_counts(W.parse_prometheus("up 1\n")) == {}
    assert W.speculating_share({}, {}) is None  # server without the counters


def test_summarize_level_counts_tokens_inside_the_window_and_skips_errors():
    # window (10.0, 12.0) on the bench's clock; token times are relative to sent_at
    results = [
        W.RequestResult(0, (0.1, 0.2, 0.3), 3, 0.3, sent_at=10.0),  # all inside
        W.RequestResult(1, (0.3, 0.5), 2, 0.5, sent_at=10.0),  # all inside
        W.RequestResult(2, (0.9,), 1, 1.0, error="HTTP 503", sent_at=10.0),
        # sent before the window: its first token (and TTFT) falls outside it
        W.RequestResult(3, (0.5, 1.2), 2, 1.2, sent_at=9.0),
        # cut off at the end: its tokens inside count, the one after does not
        W.RequestResult(4, (0.2, 0.4, 9.0), 3, 9.0, sent_at=11.5, cancelled=True),
    ]
    level = W.summarize_level("auto", "mixed", 2, results, (10.0, 12.0), 0.25, burst_gap=0.001)
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
    empty = W.summarize_level("off", "mixed", 1, [], (0.0, 1.0), None, 0.001)
    assert empty.tokens_per_s == 0.0 and empty.ttft_p50 is None


def test_run_level_holds_the_concurrency_and_cuts_off_at_the_window():
    """Two clients against a mock server that streams a token every 20 ms: each keeps one
    request in flight; the ones streaming at the end of the window are cancelled, and the
    level waits for the server to report nothing running before reading the decisions."""
    state = {"sent": 0, "open": 0, "max_open": 0, "polls_busy": 2}

    async def tokens(count: int):
        state["open"] += 1
        state["max_open"] = max(state["max_open"], state["open"])
        try:
            yield (_chunk(role="assistant", content="") + "\n\n").encode()
            for _ in range(count):
                await asyncio.sleep(0.02)
                yield (_chunk(content="t") + "\n\n").encode()
            yield b"data: [DONE]\n\n"
        finally:
            state["open"] -= 1

    def metrics() -> str:
        busy = 1 if state["polls_busy"] > 0 else 0
        state["polls_busy"] -= 1
        return METRICS.replace(
            'num_requests_running{model_name="m"} 3.0',
            f'num_requests_running{{model_name="m"}} {busy}',
        )

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            return httpx.Response(200, text=metrics())
        state["sent"] += 1
        # the first request of each client is short, the rest outlast the window
        count = 3 if state["sent"] <= 2 else 1000
        return httpx.Response(200, content=tokens(count))

    settings = P.BenchSettings({}, ("auto",), (2,), 0.3, 8, False, 0.001, 5.0)
    prompts = ["p0", "p1", "p2", "p3"]

    async def run():
        transport = httpx.MockTransport(handler)
        original = httpx.AsyncClient

        def client(**kw):
            return original(transport=transport, **kw)

        P.httpx.AsyncClient, saved = client, P.httpx.AsyncClient
        try:
            return await P.run_level("http://x", "m", prompts, 2, settings)
        finally:
            P.httpx.AsyncClient = saved

    results, (start, end), share = asyncio.run(run())
    assert end - start == pytest.approx(0.3)
    assert state["max_open"] == 2 and state["open"] == 0  # c in flight, all closed after
    assert state["polls_busy"] < 0  # waited until the server reported nothing running
    assert sorted(r.prompt_index for r in results) == [0, 1, 2, 3]  # i, i + c per client
    done = [r for r in results if not r.cancelled]
    cut = [r for r in results if r.cancelled]
    assert len(done) == 2 and len(cut) == 2
    assert all(len(r.token_times) == 3 and r.error is None for r in done)
    assert all(r.error is None and 0 < len(r.token_times) < 1000 for r in cut)
    assert share is None  # the same counters before and after: nothing decided
    level = W.summarize_level("auto", "mixed", 2, results, (start, end), share, 0.001)
    assert level.num_completion_tokens == sum(len(r.token_times) for r in results)


def test_workloads_are_distinct_and_code_edits_carry_their_code():
    code, mixed = W.code_edit_prompts(), W.mixed_prompts()
    assert len(code) == len(W.FUNCTIONS) * len(W.EDITS) == len(set(code))
    for source, old, new in W.FUNCTIONS:
        assert old in source and new not in source
        assert sum(source in p for p in code) == len(W.EDITS)
        assert any(f"`{old}` to `{new}`" in p and source in p for p in code)
    assert mixed[0::2] == code and mixed[1::2][: len(W.OPEN_CHAT)] == list(W.OPEN_CHAT)


def test_server_config_sets_mode_and_admits_every_client():
    base = {
        "engine": {"model": "m", "max_num_seqs": 16, "speculative_config": {"method": "ngram"}},
        "server": {"port": 8000},
    }
    config = P.server_config(base, "always", 32)
    assert config["engine"]["speculative_config"] == {"method": "ngram", "mode": "always"}
    assert config["engine"]["max_num_seqs"] == 32 and config["engine"]["model"] == "m"
    assert config["server"]["stream_one_token_per_chunk"] is True
    assert base["engine"]["speculative_config"] == {"method": "ngram"}  # the base is untouched
    assert P.server_config(base, "off", 4)["engine"]["max_num_seqs"] == 16
    assert "kv_cache_memory" not in config["engine"]
    assert P.server_config(base, "off", 4, 2**30)["engine"]["kv_cache_memory"] == 2**30
    with pytest.raises(SystemExit):
        P.server_config({"engine": {"model": "m"}}, "auto", 1)


def test_auto_vs_best_and_targets():
    levels = [
        _level("off", 1, 10.0),
        _level("always", 1, 20.0),
        _level("auto", 1, 19.5),
        _level("off", 8, 50.0),
        _level("always", 8, 40.0),
        _level("auto", 8, 47.0),
        _level("off", 1, 10.0, "code_edit"),
        _level("auto", 1, 16.0, "code_edit"),
    ]
    gaps = PR.auto_vs_best(levels)
    assert gaps[1] == (pytest.approx(-0.025), "always")
    assert gaps[8] == (pytest.approx(-0.06), "off")
    targets = PR.check_targets(levels)
    assert targets["auto_within_tolerance"] is False  # c=8 trails off by 6%
    assert targets["code_edit_c1_auto_over_off"] == pytest.approx(1.6)
    assert targets["code_edit_c1_target_met"] is True
    assert PR.check_targets(levels[:3] + levels[6:7])["code_edit_c1_target_met"] is None
    assert PR.check_targets(levels[:3])["auto_within_tolerance"] is True


def test_format_table_rows_and_ratio_to_off():
    table = PR.format_table([_level("auto", 2, 30.0, share=0.5), _level("off", 2, 20.0)])
    rows = table.splitlines()[2:]
    assert rows[0].startswith("| 2 | off | 20.00 | 1.00x | 100 | 200 | 10 | 20 |")
    assert rows[1].startswith("| 2 | auto | 30.00 | 1.50x |") and "| 50% |" in rows[1]


def test_stream_request_over_a_mock_transport():
    body = "\n\n".join(
        [
            _chunk(role="assistant", content=""),
            _chunk(content="a"),
            _chunk(content="b"),
            _chunk(usage={"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}),
            "data: [DONE]",
        ]
    )

    def handler(request: httpx.Request) -> httpx.Response:
        sent = json.loads(request.content)
        if sent["max_tokens"] == 0:
            return httpx.Response(400, json={"error": {"message": "max_tokens"}})
        assert sent["stream"] and sent["stream_options"] == {"include_usage": True}
        return httpx.Response(200, text=body + "\n\n")

    async def run(max_tokens: int) -> W.RequestResult:
        transport = httpx.MockTransport(handler)
        async with httpx.AsyncClient(transport=transport, base_url="http://x") as client:
            return await P.stream_request(client, P.chat_body("m", "hi", max_tokens), 3)

    ok = asyncio.run(run(8))
    assert ok.error is None and ok.num_completion_tokens == 2 and len(ok.token_times) == 2
    failed = asyncio.run(run(0))
    assert failed.error is not None and failed.error.startswith("HTTP 400")
