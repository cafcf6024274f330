"""bench/reliability/'s pure parts: the request draw, one stream read against a mock transport
(completed, cut after k chunks, an error event, a stream without [DONE]), the solo comparison,
the fuzz's body edits and the verdicts."""

from __future__ import annotations

import asyncio
import json
import random

import httpx

from bench.reliability import fuzz as F
from bench.reliability import report as RR
from bench.reliability import run as R
from bench.reliability import server as S
from bench.reliability import workload as W


def _sse(chunks: list[dict], done: bool = True) -> bytes:
    events = [f"data: {json.dumps(c)}\n\n" for c in chunks]
    return ("".join(events) + ("data: [DONE]\n\n" if done else "")).encode()


def _chat_chunks(pieces: list[str]) -> list[dict]:
    chunks = [{"choices": [{"index": 0, "delta": {"content": p}, "finish_reason": None}]}
              for p in pieces]  # fmt: skip
    chunks[-1]["choices"][0]["finish_reason"] = "length"
    return [*chunks, {"choices": [], "usage": {"completion_tokens": len(pieces)}}]


def _run(body: bytes, plan=None, kind: str = "chat", status: int = 200):
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, content=body, headers={"content-type": "text/event-stream"})

    async def go():
        transport = httpx.MockTransport(handler)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            spec = W.RequestSpec(kind, "Hello", 8)
            return await W.stream_one(client, spec, 3, "m", plan)

    return asyncio.run(go())


def test_specs_are_distinct_and_the_draw_is_seeded():
    specs = W.make_specs(40, (8, 64), random.Random(0))
    assert specs == W.make_specs(40, (8, 64), random.Random(0))
    assert len({(s.kind, s.prompt) for s in specs}) == 40
    assert {s.kind for s in specs} == {"chat", "completion"}
    assert all(8 <= s.max_tokens <= 64 for s in specs)
    rng = random.Random(1)
    plans = [W.draw_cancel(rng, 0.3, 2.0) for _ in range(2000)]
    cancelled = [p for p in plans if p is not None]
    assert 0.25 < len(cancelled) / len(plans) < 0.35
    assert any(p.num_chunks == 0 for p in cancelled)
    assert any(p.delay is not None for p in cancelled)


def test_request_bodies_are_greedy_streams_with_usage():
    chat = W.RequestSpec("chat", "Hi", 9).body("m")
    assert chat["messages"] == [{"role": "user", "content": "Hi"}]
    assert (chat["temperature"], chat["max_tokens"], chat["stream"]) == (0, 9, True)
    assert chat["stream_options"] == {"include_usage": True}
    assert W.RequestSpec("completion", "Hi", 9).body("m")["prompt"] == "Hi"
    assert W.RequestSpec("completion", "Hi", 9).path == "/v1/completions"


def test_a_stream_read_to_done():
    result = _run(_sse(_chat_chunks(["Hel", "lo", "!"])))
    assert (result.outcome, result.text, result.num_chunks) == ("completed", "Hello!", 3)
    assert (result.num_completion_tokens, result.finish_reason) == (3, "length")
    assert result.spec_index == 3
    text = [{"choices": [{"index": 0, "text": "ab", "finish_reason": "stop"}]}]
    result = _run(_sse(text), kind="completion")
    assert (result.outcome, result.text, result.finish_reason) == ("completed", "ab", "stop")


def test_a_stream_cut_by_its_plan():
    body = _sse(_chat_chunks(["a", "b", "c", "d"]))
    before_any = _run(body, W.CancelPlan(num_chunks=0))
    assert (before_any.outcome, before_any.num_chunks, before_any.text) == ("cancelled", 0, "")
    after_two = _run(body, W.CancelPlan(num_chunks=2))
    assert (after_two.outcome, after_two.text) == ("cancelled", "ab")
    too_late = _run(body, W.CancelPlan(num_chunks=8))  # the stream ended first
    assert too_late.outcome == "completed"


def test_failures_are_errors():
    error = _run(_sse([{"error": {"message": "boom"}}]))
    assert error.outcome == "error" and "boom" in error.error
    cut = _run(_sse(_chat_chunks(["a"]), done=False))
    assert cut.outcome == "error" and "[DONE]" in cut.error
    status = _run(b'{"error": {}}', status=500)
    assert status.outcome == "error" and "HTTP 500" in status.error


def test_mismatches_name_the_first_difference():
    done = W.StreamResult(0, "completed", "abcdef", 3, 3, "length")
    same = W.StreamResult(1, "completed", "xyz", 1, 2, "stop")
    solo = {0: W.StreamResult(0, "completed", "abcXef", 3, 3, "length"), 1: same}
    (found,) = R.mismatches([done, same], solo)
    assert (found["spec_index"], found["first_difference_at"]) == (0, 3)
    longer = {0: W.StreamResult(0, "completed", "abcdef", 3, 4, "length"), 1: same}
    assert R.mismatches([done], longer)[0]["tokens"] == [3, 4]


def test_fuzz_bodies_pin_the_model_and_cap_generation():
    body = {"model": "gpt-4", "messages": [], "max_tokens": 500, "n": 7, "stream": False}
    edited = F.prepare(body, "served", True)
    assert edited == {"model": "served", "messages": [], "max_tokens": 4, "n": 2, "stream": True}
    assert body["model"] == "gpt-4"  # a copy
    assert F.prepare({"model": "x", "max_tokens": -3}, "s", False)["max_tokens"] == -3
    assert F.prepare({"model": "x"}, "s", True)["max_tokens"] == F.MAX_NEW_TOKENS
    assert F.prepare({"model": "x"}, "s", True)["stream"] is True
    assert F.prepare({"model": "x", "stream": "yes"}, "s", True)["stream"] == "yes"
    assert F.prepare(["not", "an", "object"], "s", True) == ["not", "an", "object"]


def test_verdicts_fail_on_a_dirty_engine_and_report_rss_as_a_target():
    clean = S.Idle(0, 0, 0, 5, {"ok": True}, 0.1)
    dirty = S.Idle(1, 0, 0.25, 5, {"ok": False, "error": "block 3: ref count"}, 60.0)
    soak = R.SoakResult(600, 10, 4, 0, ((60.0, 1000), (600.0, 1100)), 60.0, 1000, 1100, 10.0,
                        clean, ())  # fmt: skip
    churn = R.ChurnResult(10, 7, 3, 3, 0, 4, dirty, 7, 5, (), (), 12.0)
    checks = RR.verdicts(R.Results(churn, soak, None, None))
    failed = {(c["part"], c["name"]) for c in checks if not c["held"]}
    assert failed == {
        ("churn", "running / waiting / KV usage after"),
        ("churn", "block manager integrity check"),
        ("soak", "RSS growth"),
    }
    rss = next(c for c in checks if c["name"] == "RSS growth")
    assert rss["kind"] == "target" and rss["value"] == "+10.00%"
    assert "no (target)" in RR.report(R.Results(churn, soak, None, None), checks)
