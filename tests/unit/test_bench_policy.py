"""bench/policy.py's pure parts (bench/policy_report.py's included): percentiles, inter-token
latency, SSE and Prometheus parsing, level aggregation, the report's comparisons, the per-mode
server config and one streamed request against a mock transport."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import json
import random

import httpx
import numpy as np
import pytest

from tests.unit.bench_scripts import load_bench_script

P, W, PR, C = load_bench_script("policy.py", "policy_workload", "policy_report", "policy_clients")


def _level(mode, c, tps, workload="mixed", share=None, round=0) -> W.LevelResult:
    return W.LevelResult(
        mode, workload, c, 4, 0, 100, 1.0, tps, 0.1, 0.2, 0.01, 0.02, share, round=round
    )


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
    assert reader.text == "def f"  # the content, for bench/humaneval.py to execute
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


def _serve_levels_with(monkeypatch, handler) -> None:
    """A level's client talks to `handler` (an httpx.MockTransport) instead of a server."""
    transport = httpx.MockTransport(handler)

    def client(url, headers, concurrency):
        return httpx.AsyncClient(base_url=url, headers=headers, timeout=900.0, transport=transport)

    monkeypatch.setattr(C, "level_client", client)


def test_run_level_holds_the_concurrency_and_cuts_off_at_the_window(monkeypatch):
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
        assert request.headers["authorization"] == "Bearer sk-k"
        if request.url.path == "/metrics":
            return httpx.Response(200, text=metrics())
        state["sent"] += 1
        # the first request of each client is short, the rest outlast the window
        count = 3 if state["sent"] <= 2 else 1000
        return httpx.Response(200, content=tokens(count))

    settings = P.BenchSettings({}, ("auto",), (2,), 0.3, 8, False, 0.001, 5.0)
    prompts = ["p0", "p1", "p2", "p3"]

    _serve_levels_with(monkeypatch, handler)
    headers = {"Authorization": "Bearer sk-k"}
    level = P.run_level("http://x", headers, "m", prompts, 2, settings, offset=1)
    results, (start, end), share = asyncio.run(level)
    assert end - start == pytest.approx(0.3)
    assert state["max_open"] == 2 and state["open"] == 0  # c in flight, all closed after
    assert state["polls_busy"] < 0  # waited until the server reported nothing running
    # client i sends offset + i, then offset + i + c (of 4 prompts): 1, 3 and 2, 0
    assert [r.prompt_index for r in results] == [1, 3, 2, 0]
    done = [r for r in results if not r.cancelled]
    cut = [r for r in results if r.cancelled]
    assert len(done) == 2 and len(cut) == 2
    assert all(len(r.token_times) == 3 and r.error is None for r in done)
    assert all(r.error is None and 0 < len(r.token_times) < 1000 for r in cut)
    assert share is None  # the same counters before and after: nothing decided
    level = W.summarize_level("auto", "mixed", 2, results, (start, end), share, 0.001)
    # The window's tokens: on a loaded host a cancelled stream may still record one after `end`.
    in_window = [t for r in results for t in r.token_times if start <= r.sent_at + t <= end]
    assert level.num_completion_tokens == len(in_window) > 0


def test_sliced_level_counts_each_mode_from_the_servers_counters(monkeypatch):
    """One load, the modes in turn: each slice's tokens and seconds are what the server counted
    for its mode between the scrapes around its switches. The mock's engine runs one step of the
    current mode per scrape (off 10 tokens a second, always 20, auto 30): every slice must read
    its own mode's rate, whichever modes came before it."""
    rates = {"off": 10.0, "always": 20.0, "auto": 30.0}
    state = {"mode": "auto", "switches": [], "open": 0, "max_open": 0}
    tokens = dict.fromkeys(rates, 0.0)
    seconds = dict.fromkeys(rates, 0.0)
    decided = {"speculate": 0, "skip": 0}

    def metrics() -> str:
        mode = state["mode"]  # a step of the current mode ran since the last scrape
        tokens[mode] += rates[mode]
        seconds[mode] += 1.0
        decided["skip" if mode == "off" else "speculate"] += 1
        lines = ['specserve:num_requests_running{model_name="m"} 0']
        for name, counts in ((W.MODE_TOKENS, tokens), (W.MODE_SECONDS, seconds)):
            lines += [f'{name}{{mode="{m}",model_name="m"}} {v}' for m, v in counts.items()]
        reasons = {"speculate": "goodput", "skip": "mode_off"}
        lines += [
            f'{W.DECISIONS}{{decision="{d}",model_name="m",reason="{reasons[d]}"}} {n}'
            for d, n in decided.items()
        ]
        return "\n".join(lines) + "\n"

    async def stream():
        state["open"] += 1
        state["max_open"] = max(state["max_open"], state["open"])
        try:
            for _ in range(1000):
                await asyncio.sleep(0.01)
                yield (_chunk(content="t") + "\n\n").encode()
        finally:
            state["open"] -= 1

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            return httpx.Response(200, text=metrics())
        if request.url.path == "/internal/speculation":
            assert request.method == "PUT"
            state["mode"] = json.loads(request.content)["mode"]
            state["switches"].append(state["mode"])
            return httpx.Response(200, json={"mode": state["mode"]})
        return httpx.Response(200, content=stream())

    modes = ("off", "always", "auto")
    settings = P.BenchSettings({}, modes, (2,), 0.3, 8, False, 0.001, 5.0, rounds=2, slice=0.15)
    schedule = [(r, m) for r in range(2) for m in P.window_order(modes, r)]

    _serve_levels_with(monkeypatch, handler)
    sliced = C.run_sliced("http://x", {}, "m", ["p0", "p1"], 2, settings, schedule)
    results, slices = asyncio.run(sliced)
    # the lead-in (not counted) in the first slice's mode, then a switch per slice
    assert state["switches"] == [schedule[0][1]] + [m for _, m in schedule]
    assert state["max_open"] == 2 and state["open"] == 0  # one load of c = 2 throughout
    assert all(r.cancelled for r in results) and len(results) == 2  # never stopped in between
    assert [(s.round, s.mode) for s in slices] == schedule
    for s in slices:
        assert s.seconds >= 2 and s.num_tokens / s.seconds == rates[s.mode]
        assert s.share == (0.0 if s.mode == "off" else 1.0)
    # every step counted once, in its slice, but the lead-in's before the first switch
    assert sum(s.num_tokens for s in slices) == sum(tokens.values()) - rates[schedule[0][1]]
    windows = [s.window for s in slices]
    assert all(a[1] == b[0] for a, b in itertools.pairwise(windows))  # back to back
    assert 0 < windows[-1][1] - windows[0][0] <= 0.15 * len(schedule)  # inside the level


def test_request_lengths_spread_evenly_around_max_tokens():
    """Requests ask for lengths spread over max_tokens * (1 +- spread), so c clients fall out of
    step; a level's request n asks for the same length in every mode; spread 0 asks for one."""
    lengths = [C.request_max_tokens(96, 0.5, n) for n in range(64)]
    assert min(lengths) >= 48 and max(lengths) <= 144
    assert abs(sum(lengths) / len(lengths) - 96) < 3
    assert len(set(lengths)) > 40  # no two clients alike
    assert all(len(set(lengths[i : i + 16])) == 16 for i in range(0, 64, 16))  # nor in one round
    assert lengths == [C.request_max_tokens(96, 0.5, n) for n in range(64)]
    assert {C.request_max_tokens(96, 0.0, n) for n in range(64)} == {96}
    assert C.request_max_tokens(1, 0.9, 0) == 1


def test_workloads_are_distinct_and_code_edits_carry_their_code():
    code, mixed = W.code_edit_prompts(), W.mixed_prompts()
    assert len(code) == len(W.FUNCTIONS) * len(W.EDITS) == len(set(code))
    for source, old, new in W.FUNCTIONS:
        assert old in source and new not in source
        assert sum(source in p for p in code) == len(W.EDITS)
        assert any(f"`{old}` to `{new}`" in p and source in p for p in code)
    assert mixed[0::2] == code and mixed[1::2][: len(W.OPEN_CHAT)] == list(W.OPEN_CHAT)


def test_open_chat_and_code_gen_are_workloads_of_their_own():
    assert list(W.WORKLOADS) == ["mixed", "code_edit", "open_chat", "code_gen"]
    chat, gen = W.WORKLOADS["open_chat"](), W.WORKLOADS["code_gen"]()
    assert chat == list(W.OPEN_CHAT) and len(chat) == len(set(chat)) > 0
    assert len(gen) == len(W.CODE_GEN) == len(set(gen)) >= 10
    assert not set(gen) & set(W.mixed_prompts())  # new prompts, not in mixed
    names = set()
    for code, prompt in zip(W.CODE_GEN, gen, strict=True):
        assert prompt == W.complete_function_prompt(code)
        assert prompt.endswith(f"```python\n{code}```") and code.startswith("def ")
        assert code.rstrip().endswith('"""') and ">>> " in code  # a docstring with an example
        names.add(code[4 : code.index("(")])
        compile(code + "    pass\n", "<code_gen>", "exec")  # a signature Python accepts
    assert len(names) == len(W.CODE_GEN)  # every function a different one


def test_workloads_option_measures_each_workload_at_each_concurrency():
    settings, _ = P.parse_args([])
    assert settings.workloads == ("mixed",)  # as before the option
    assert P.levels_of(settings) == [("mixed", c) for c in (1, 2, 4, 8, 16, 32)] + [
        ("code_edit", 1)
    ]
    both, _ = P.parse_args(["--workloads", "code_gen, mixed,code_gen", "--concurrency", "1,4"])
    assert both.workloads == ("code_gen", "mixed")  # in the order given, once each
    assert P.levels_of(both) == [
        ("code_gen", 1),
        ("code_gen", 4),
        ("mixed", 1),
        ("mixed", 4),
        ("code_edit", 1),
    ]
    edits, _ = P.parse_args(["--workloads", "code_edit", "--concurrency", "1,2"])
    assert P.levels_of(edits) == [("code_edit", 1), ("code_edit", 2)]  # c = 1 not twice
    none, _ = P.parse_args(["--workloads", "open_chat", "--concurrency", "2", "--no-code-edit-c1"])
    assert P.levels_of(none) == [("open_chat", 2)]
    for wrong in ("chat", ""):
        with pytest.raises(SystemExit):
            P.parse_args(["--workloads", wrong])


def test_bench_all_fills_the_cache_with_every_workload_and_measures_each(monkeypatch):
    """Every prompt of every level's workload is cached once before the first level; each
    workload is measured at each concurrency, then code edit at c = 1."""
    filled, measured = [], []

    @contextlib.contextmanager
    def server(config, timeout):
        yield "http://x"

    class Models:
        def json(self):
            return {"data": [{"id": "m"}]}

    async def fill(url, headers, model, prompts):
        filled.extend(prompts)

    async def level(url, headers, model, prompts, c, settings, offset):
        measured.append((tuple(prompts), c))
        return [], (0.0, 1.0), None

    monkeypatch.setattr(P, "running_server", server)
    monkeypatch.setattr(P.httpx, "get", lambda *a, **kw: Models())
    monkeypatch.setattr(P, "operate", lambda *a, **kw: None)
    monkeypatch.setattr(P, "fill_prefix_cache", fill)
    monkeypatch.setattr(P, "warm_up", lambda *a: None)
    monkeypatch.setattr(P, "run_level", level)
    config = {"engine": {"speculative_config": {"method": "ngram"}}}
    settings = P.BenchSettings(
        config, ("off",), (2,), 1.0, 8, True, 0.001, 5.0, workloads=("open_chat", "code_gen")
    )
    results = P.bench_all(settings)
    assert sorted(filled) == sorted(
        {*W.open_chat_prompts(), *W.code_gen_prompts(), *W.code_edit_prompts()}
    )
    assert measured == [
        (tuple(W.open_chat_prompts()), 2),
        (tuple(W.code_gen_prompts()), 2),
        (tuple(W.code_edit_prompts()), 1),
    ]
    assert [(r.workload, r.concurrency) for r in results] == [
        ("open_chat", 2),
        ("code_gen", 2),
        ("code_edit", 1),
    ]


def test_report_has_a_table_and_a_comparison_per_workload():
    levels = [
        _level(mode, c, tps * scale, workload=w)
        for w, scale in (("mixed", 1.0), ("code_gen", 2.0))
        for c in (1, 4)
        for mode, tps in (("off", 10.0), ("auto", 12.0))
    ]
    levels += [_level("off", c, 10.0, "code_edit") for c in (1, 4)]
    levels += [_level("auto", 1, 16.0, "code_edit"), _level("auto", 4, 30.0, "code_edit")]
    text = PR.report(levels)
    headings = [line for line in text.splitlines() if line.endswith(":")]
    assert headings == [
        "Mixed workload (code edit + open chat):",
        "Code generation (functions to complete):",
        "Code edit only:",
    ]
    assert "c=4: auto vs best(off): +20.0% median" in text  # mixed: unprefixed, as before
    assert "code_gen c=4: auto vs best(off): +20.0% median" in text
    assert "code_edit c=4: auto vs best(off): +200.0% median" in text
    targets = PR.check_targets(levels)
    assert targets["code_edit_c1_auto_over_off"] == pytest.approx(1.6)  # c = 1's, not c = 4's
    assert set(targets["auto_vs_best"]) == {1, 4}  # the target stays on the mixed workload
    assert "Code edit only, concurrency 1:" in PR.report([x for x in levels if x.concurrency == 1])


def test_server_config_starts_in_auto_with_a_key_and_admits_every_client(monkeypatch):
    monkeypatch.delenv("SPECSERVE_API_KEY", raising=False)
    base = {
        "engine": {"model": "m", "max_num_seqs": 16, "speculative_config": {"method": "ngram"}},
        "server": {"port": 8000},
    }
    config = P.server_config(base, 32)
    assert config["engine"]["speculative_config"] == {"method": "ngram", "mode": "auto"}
    assert config["engine"]["max_num_seqs"] == 32 and config["engine"]["model"] == "m"
    assert config["server"]["stream_one_token_per_chunk"] is True
    key = config["server"]["api_key"]
    assert key.startswith("sk-bench-") and P.auth_headers(config) == {
        "Authorization": f"Bearer {key}"
    }
    assert P.server_config(base, 32)["server"]["api_key"] != key  # a new one each time
    assert base["engine"]["speculative_config"] == {"method": "ngram"}  # the base is untouched
    assert "api_key" not in base["server"]
    assert P.server_config(base, 4)["engine"]["max_num_seqs"] == 16
    assert "kv_cache_memory" not in config["engine"]
    assert P.server_config(base, 4, 2**30)["engine"]["kv_cache_memory"] == 2**30
    keyed = {**base, "server": {"api_key": "sk-own"}}
    assert P.server_config(keyed, 1)["server"]["api_key"] == "sk-own"
    monkeypatch.setenv("SPECSERVE_API_KEY", "sk-env")  # what the server itself would use
    assert P.server_config(keyed, 1)["server"]["api_key"] == "sk-env"
    with pytest.raises(SystemExit):
        P.server_config({"engine": {"model": "m"}}, 1)


def test_every_mode_leads_a_round_as_often_as_the_others():
    modes = ("off", "always", "auto")
    orders = [P.window_order(modes, r) for r in range(6)]
    assert orders[:3] == [
        ["off", "always", "auto"],
        ["always", "auto", "off"],
        ["auto", "off", "always"],
    ]
    assert orders[3:] == [  # then reversed: each mode follows each other one as often
        ["auto", "always", "off"],
        ["always", "off", "auto"],
        ["off", "auto", "always"],
    ]
    for position in range(3):
        assert sorted(o[position] for o in orders[:3]) == sorted(modes)
        assert sorted(o[position] for o in orders[3:]) == sorted(modes)
    follows = collections.Counter(pair for o in orders for pair in itertools.pairwise(o))
    assert set(follows.values()) == {2} and len(follows) == 6  # every ordered pair, twice
    assert P.window_order(modes, 6) == orders[0]
    assert [P.window_order(("off", "auto"), r) for r in range(4)] == [
        ["off", "auto"],
        ["auto", "off"],
        ["auto", "off"],
        ["off", "auto"],
    ]


def test_bench_all_interleaves_the_modes_within_each_level(monkeypatch):
    """One server; each mode warmed up once; per level, rounds of every mode back to back, each
    window after a switch and a cache reset, each result tagged with its round."""
    calls, offsets = [], []

    @contextlib.contextmanager
    def server(config, timeout):
        calls.append(("start", config["engine"]["speculative_config"]["mode"]))
        yield "http://x"

    class Models:
        def json(self):
            return {"data": [{"id": "m"}]}

    async def level(url, headers, model, prompts, c, settings, offset):
        calls.append(("window", c))
        offsets.append(offset)
        return [], (0.0, 1.0), None

    monkeypatch.setattr(P, "running_server", server)
    monkeypatch.setattr(P.httpx, "get", lambda *a, **kw: Models())
    monkeypatch.setattr(
        P, "operate", lambda url, headers, mode, is_cold: calls.append(("mode", mode, is_cold))
    )

    async def fill(url, headers, model, prompts):
        calls.append(("fill", len(prompts)))

    monkeypatch.setattr(P, "fill_prefix_cache", fill)
    monkeypatch.setattr(P, "warm_up", lambda *a: calls.append(("warm",)))
    monkeypatch.setattr(P, "run_level", level)
    config = {"engine": {"speculative_config": {"method": "ngram"}}}
    settings = P.BenchSettings(config, ("off", "auto"), (1, 4), 1.0, 8, True, 0.001, 5.0, rounds=2)
    results = P.bench_all(settings)
    warm = [("mode", "off", False), ("warm",), ("mode", "auto", False), ("warm",)]
    # every distinct prompt once (the mixed workload holds the code edits)
    assert calls[:6] == [("start", "auto"), *warm, ("fill", len(W.mixed_prompts()))]
    assert all(c[2] is False for c in calls[6:] if c[0] == "mode")  # warm: never emptied
    windows = [(a[1], b[1]) for a, b in itertools.pairwise(calls[6:]) if a[0] == "mode"]
    assert windows == [("off", 1), ("auto", 1), ("auto", 1), ("off", 1)] + [
        ("off", 4),
        ("auto", 4),
        ("auto", 4),
        ("off", 4),
    ] + [("off", 1), ("auto", 1), ("auto", 1), ("off", 1)]
    tagged = [(r.mode, r.workload, r.concurrency, r.round) for r in results]
    assert tagged[:4] == [
        ("off", "mixed", 1, 0),
        ("auto", "mixed", 1, 0),
        ("auto", "mixed", 1, 1),
        ("off", "mixed", 1, 1),
    ]
    assert tagged[-1] == ("off", "code_edit", 1, 1) and len(tagged) == 12
    # the rounds start half the workload apart (24 mixed prompts, 12 code edits), both modes alike
    assert offsets == [0, 0, 12, 12] * 2 + [0, 0, 6, 6]
    assert [P.prompt_offset(24, r, 3) for r in range(3)] == [0, 8, 16]
    assert [P.prompt_offset(12, r, 5) for r in range(5)] == [0, 2, 4, 6, 8]

    calls.clear()
    P.bench_all(dataclasses.replace(settings, is_cold=True))
    assert not any(c[0] == "fill" for c in calls)
    assert calls[:5] == [("start", "auto"), *warm]
    assert all(c[2] is True for c in calls[5:] if c[0] == "mode")  # emptied before each window


def test_auto_vs_best_pairs_the_rounds_and_judges_the_median():
    levels = []
    for r, (off, always, auto) in enumerate(
        [(10.0, 20.0, 19.5), (12.0, 18.0, 19.8), (9.0, 22.0, 19.8)]
    ):
        levels += [_level("off", 1, off, round=r), _level("always", 1, always, round=r)]
        levels.append(_level("auto", 1, auto, round=r))
    for r, (off, always, auto) in enumerate(
        [(50.0, 40.0, 47.0), (40.0, 30.0, 41.0), (52.0, 41.0, 49.0)]
    ):
        levels += [_level("off", 8, off, round=r), _level("always", 8, always, round=r)]
        levels.append(_level("auto", 8, auto, round=r))
    levels += [_level("off", 1, 10.0, "code_edit", round=r) for r in range(3)]
    levels += [_level("auto", 1, x, "code_edit", round=r) for r, x in enumerate([16.0, 14.0, 17.0])]
    gaps = PR.auto_vs_best(levels)
    assert gaps[1].best == "always"  # the higher median: 20 against 10
    assert gaps[1].per_round == pytest.approx((-0.025, 0.1, -0.1))
    assert gaps[1].median == pytest.approx(-0.025)
    assert gaps[8].best == "off"
    assert gaps[8].per_round == pytest.approx((-0.06, 0.025, 49 / 52 - 1))
    assert gaps[8].median == pytest.approx(49 / 52 - 1)  # -5.8%: paired in its round
    targets = PR.check_targets(levels)
    assert targets["auto_vs_best"][1] == pytest.approx(-0.025)
    assert targets["auto_within_tolerance"] is False  # c=8 trails off by 5.8%
    assert targets["code_edit_c1_per_round"] == pytest.approx([1.6, 1.4, 1.7])
    assert targets["code_edit_c1_auto_over_off"] == pytest.approx(1.6)
    assert targets["code_edit_c1_target_met"] is True
    c1 = [x for x in levels if x.concurrency == 1 and x.workload == "mixed"]
    assert PR.check_targets(c1)["auto_within_tolerance"] is True
    assert PR.check_targets(c1)["code_edit_c1_target_met"] is None
    single = PR.check_targets([x for x in levels if x.round == 0])  # one round: as it reads
    assert single["auto_vs_best"] == pytest.approx({1: -0.025, 8: -0.06})
    # A run of off and auto alone judges auto against off; without a fixed mode, not at all.
    no_always = [x for x in levels if x.mode != "always"]
    assert {c: g.best for c, g in PR.auto_vs_best(no_always).items()} == {1: "off", 8: "off"}
    assert PR.auto_vs_best(no_always)[1].per_round == pytest.approx((0.95, 0.65, 1.2))
    assert "c=1: auto vs best(off): +95.0% median" in PR.report(no_always)
    assert PR.auto_vs_best([x for x in levels if x.mode == "auto"]) == {}


def test_pooled_ratios_weigh_each_slice_by_its_seconds():
    # One client, code edits: each slice held a request or two, so rounds pair different edits.
    def level(mode, round, tokens, seconds):
        return W.LevelResult(
            mode,
            "code_edit",
            1,
            2,
            0,
            tokens,
            seconds,
            tokens / seconds,
            0.1,
            0.2,
            0.01,
            0.02,
            None,
            round=round,
        )

    slices = [(120, 10.0, 240, 10.0), (120, 10.0, 130, 10.0), (60, 5.0, 130, 10.0)]
    levels = []
    for r, (off_tokens, off_s, auto_tokens, auto_s) in enumerate(slices):
        levels += [level("off", r, off_tokens, off_s), level("auto", r, auto_tokens, auto_s)]
    targets = PR.check_targets(levels)
    assert targets["code_edit_c1_per_round"] == pytest.approx([2.0, 130 / 120, 13 / 12])
    assert targets["code_edit_c1_auto_over_off"] == pytest.approx(13 / 12)  # the median
    # pooled: 500 tokens in 30 s against 300 in 25 s
    assert targets["code_edit_c1_pooled"] == pytest.approx((500 / 30) / (300 / 25))
    gap = PR.auto_vs_best(levels, "code_edit")[1]
    assert gap.pooled == pytest.approx((500 / 30) / (300 / 25) - 1)
    report = PR.report(levels)
    assert "(pooled over the rounds: 1.39x)" in report
    assert "+8.3% median, +38.9% pooled" in report
    assert PR.pooled([level("auto", 0, 10, 1.0)], [level("off", 0, 0, 1.0)]) is None


def test_format_table_shows_the_medians_their_range_and_the_ratio_to_off():
    table = PR.format_table([_level("auto", 2, 30.0, share=0.5), _level("off", 2, 20.0)])
    rows = table.splitlines()[2:]
    assert rows[0].startswith("| 2 | off | 20.00 | - | 1.00x | 100 | 200 | 10 | 20 |")
    assert rows[1].startswith("| 2 | auto | 30.00 | - | 1.50x |") and "| 50% |" in rows[1]
    rounds = [_level("off", 2, x, round=r) for r, x in enumerate([20.0, 26.0, 21.0])]
    rounds += [_level("auto", 2, x, share=0.5, round=r) for r, x in enumerate([30.0, 31.5, 27.0])]
    rows = PR.format_table(rounds).splitlines()[2:]
    assert rows[0].startswith("| 2 | off | 21.00 | 20.00-26.00 | 1.00x |")
    assert rows[1].startswith("| 2 | auto | 30.00 | 27.00-31.50 | 1.43x |")
    (off,) = [r for r in PR.combined(rounds) if r.mode == "off"]
    assert off.num_requests == 12 and off.num_completion_tokens == 300 and off.round == 3


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


def test_a_sliced_level_is_one_load_and_reads_each_slice_from_the_server(monkeypatch):
    """bench_all with slices: per level one run_sliced over every (round, mode) in rotated
    order, no window of its own per mode; each result's tokens/s is the slice's server count."""
    schedules = []

    @contextlib.contextmanager
    def server(config, timeout):
        yield "http://x"

    class Models:
        def json(self):
            return {"data": [{"id": "m"}]}

    async def sliced(url, headers, model, prompts, c, settings, schedule):
        schedules.append((c, list(schedule)))
        # round r of mode m: 10 * (r + 1) tokens over 2 s (off) or 4 s (auto)
        return [], [
            C.Slice(r, m, (float(i), i + 1.0), 10.0 * (r + 1), 2.0 if m == "off" else 4.0, None)
            for i, (r, m) in enumerate(schedule)
        ]

    monkeypatch.setattr(P, "running_server", server)
    monkeypatch.setattr(P.httpx, "get", lambda *a, **kw: Models())
    monkeypatch.setattr(P, "operate", lambda *a, **kw: None)
    monkeypatch.setattr(P, "warm_up", lambda *a: None)

    async def fill(*a):
        return None

    monkeypatch.setattr(P, "fill_prefix_cache", fill)
    monkeypatch.setattr(P, "run_sliced", sliced)
    monkeypatch.setattr(P, "run_level", None)  # never a window
    config = {"engine": {"speculative_config": {"method": "ngram"}}}
    settings = P.BenchSettings(
        config, ("off", "auto"), (2,), 1.0, 8, False, 0.001, 5.0, rounds=2, slice=3.0
    )
    results = P.bench_all(settings)
    assert schedules == [(2, [(0, "off"), (0, "auto"), (1, "auto"), (1, "off")])]
    got = [(r.round, r.mode, r.num_completion_tokens, r.wall_time, r.tokens_per_s) for r in results]
    assert got == [
        (0, "off", 10, 2.0, 5.0),
        (0, "auto", 10, 4.0, 2.5),
        (1, "auto", 20, 4.0, 5.0),
        (1, "off", 20, 2.0, 10.0),
    ]


def test_levels_are_sliced_unless_windows_are_asked_for():
    settings, _ = P.parse_args([])
    assert (settings.slice, settings.rounds, settings.is_cold) == (10.0, 6, False)
    windows, _ = P.parse_args(["--slice", "0", "--rounds", "3", "--prefix-cache", "cold"])
    assert (windows.slice, windows.rounds, windows.is_cold) == (0.0, 3, True)
    with pytest.raises(SystemExit):  # a cold cache is emptied between windows; slices have none
        P.parse_args(["--prefix-cache", "cold"])
