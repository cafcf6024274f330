"""bench/policy/clients.py against a mock transport: a level's closed-loop clients in a window
and in slices read from the server's counters, the requests' lengths, one streamed request."""

from __future__ import annotations

import asyncio
import itertools
import json

import httpx
import pytest

from bench.policy import clients as C
from bench.policy import counters
from bench.policy import measurements as M
from bench.policy import run as P
from bench.policy import settings as S
from tests.unit.bench_policy_fakes import METRICS, chunk


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
            yield (chunk(role="assistant", content="") + "\n\n").encode()
            for _ in range(count):
                await asyncio.sleep(0.02)
                yield (chunk(content="t") + "\n\n").encode()
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

    settings = S.BenchSettings({}, ("auto",), (2,), 0.3, 8, False, 0.001, 5.0)
    prompts = ["p0", "p1", "p2", "p3"]

    _serve_levels_with(monkeypatch, handler)
    headers = {"Authorization": "Bearer sk-k"}
    level = C.run_level("http://x", headers, "m", prompts, 2, settings, offset=1)
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
    level = M.summarize_level("auto", "mixed", 2, results, (start, end), share, 0.001)
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
        for name, counts in ((counters.MODE_TOKENS, tokens), (counters.MODE_SECONDS, seconds)):
            lines += [f'{name}{{mode="{m}",model_name="m"}} {v}' for m, v in counts.items()]
        reasons = {"speculate": "goodput", "skip": "mode_off"}
        lines += [
            f'{counters.DECISIONS}{{decision="{d}",model_name="m",reason="{reasons[d]}"}} {n}'
            for d, n in decided.items()
        ]
        return "\n".join(lines) + "\n"

    async def stream():
        state["open"] += 1
        state["max_open"] = max(state["max_open"], state["open"])
        try:
            for _ in range(1000):
                await asyncio.sleep(0.01)
                yield (chunk(content="t") + "\n\n").encode()
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
    settings = S.BenchSettings({}, modes, (2,), 0.3, 8, False, 0.001, 5.0, rounds=2, slice=0.15)
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


def test_stream_request_over_a_mock_transport():
    body = "\n\n".join(
        [
            chunk(role="assistant", content=""),
            chunk(content="a"),
            chunk(content="b"),
            chunk(usage={"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}),
            "data: [DONE]",
        ]
    )

    def handler(request: httpx.Request) -> httpx.Response:
        sent = json.loads(request.content)
        if sent["max_tokens"] == 0:
            return httpx.Response(400, json={"error": {"message": "max_tokens"}})
        assert sent["stream"] and sent["stream_options"] == {"include_usage": True}
        return httpx.Response(200, text=body + "\n\n")

    async def run(max_tokens: int) -> M.RequestResult:
        transport = httpx.MockTransport(handler)
        async with httpx.AsyncClient(transport=transport, base_url="http://x") as client:
            return await C.stream_request(client, C.chat_body("m", "hi", max_tokens), 3)

    ok = asyncio.run(run(8))
    assert ok.error is None and ok.num_completion_tokens == 2 and len(ok.token_times) == 2
    failed = asyncio.run(run(0))
    assert failed.error is not None and failed.error.startswith("HTTP 400")
