"""The HTTP server end to end: real uvicorn servers on loopback, the official `openai` client
(sync and async) and raw httpx, over a tiny random-weight Llama with SmolLM2's tokenizer.

Server `server`: the default settings (engine loaded by the app's lifespan). Server `guarded`:
an API key, a queue of 2 with one sequence at a time, one SSE chunk per token, and speculation
from the request's `prediction` (so steps yield several tokens). Every chunk and body is checked
against the official OpenAPI spec; disconnects are checked to abort their engine requests.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from engine.engine import LLMEngine
from engine.tokenizer import apply_chat_template
from server.app import create_app
from server.async_engine import AsyncEngine
from server.settings import Settings
from tests.e2e.conftest import IDLE, LiveServer, live_server, wait_healthy, wait_idle
from tests.openapi_spec import assert_valid, spec_schemas, validators

jsonschema = pytest.importorskip("jsonschema")

MODEL = "tiny-chat"
GUARDED = "tiny-guarded"
API_KEY = "sk-test-0123456789"
MAX_MODEL_LEN = 512
MAX_BODY = 256 * 1024
HELLO = [{"role": "user", "content": "Hello there, how are you?"}]


def _settings(model_path: Path, **overrides: Any) -> Settings:
    values: dict[str, Any] = dict(
        model=str(model_path),
        served_model_name=MODEL,
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        block_size=16,
        num_kv_blocks=256,
        max_num_seqs=16,
        max_num_batched_tokens=512,
        max_body_bytes=MAX_BODY,
        cors_allow_origins=["http://allowed.example"],
    )
    values.update(overrides)
    return Settings(**values)


@pytest.fixture(scope="module")
def server(tiny_chat_model) -> Iterator[LiveServer]:
    with live_server(create_app(_settings(tiny_chat_model))) as live:
        yield live


@pytest.fixture(scope="module")
def guarded(tiny_chat_model) -> Iterator[LiveServer]:
    settings = _settings(
        tiny_chat_model,
        served_model_name=GUARDED,
        api_key=API_KEY,
        max_queue=2,
        max_num_seqs=1,
        stream_one_token_per_chunk=True,
        # always: the tests here check what speculation does, not whether it pays on a tiny model.
        speculative_config={"method": "prediction", "num_speculative_tokens": 4, "mode": "always"},
    )
    # The other way in: the caller builds the engine; the lifespan starts and stops it.
    engine = AsyncEngine(LLMEngine(settings.engine_config()), settings.max_queue)
    with live_server(create_app(settings, engine)) as live:
        yield live


@pytest.fixture(scope="module")
def schemas() -> dict[str, Any]:
    found = spec_schemas()
    names = [
        "CreateChatCompletionResponse",
        "CreateChatCompletionStreamResponse",
        "CreateCompletionResponse",
        "ListModelsResponse",
        "Model",
        "ErrorResponse",
    ]
    return validators(names, found)


def _client(live: LiveServer, key: str = "unused", **kw: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.base_url}/v1", api_key=key, max_retries=0, **kw)


def _async_client(live: LiveServer, key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{live.base_url}/v1", api_key=key, max_retries=0)


def _events(response: httpx.Response) -> list[Any]:
    """The SSE events of a whole response: decoded JSON, and the string "[DONE]"."""
    events = []
    for block in response.text.split("\n\n"):
        if block:
            assert block.startswith("data: "), block
            payload = block[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def _chat_body(model: str = MODEL, **fields: Any) -> dict[str, Any]:
    return {"model": model, "messages": HELLO, "max_tokens": 8, **fields}


@contextmanager
def _tracked(live: LiveServer) -> Iterator[dict[str, list[str]]]:
    """Records the engine's add_request and abort calls (on the engine thread)."""
    seen: dict[str, list[str]] = {"added": [], "aborted": []}

    def install(engine: LLMEngine) -> None:
        add, abort = engine.add_request, engine.abort

        def add_request(request_id: str, *args: Any, **kw: Any) -> None:
            add(request_id, *args, **kw)
            seen["added"].append(request_id)

        def do_abort(request_id: str) -> bool:
            found = abort(request_id)
            if found:
                seen["aborted"].append(request_id)
            return found

        engine.add_request, engine.abort = add_request, do_abort  # type: ignore[method-assign]

    def uninstall(engine: LLMEngine) -> None:
        del engine.add_request, engine.abort

    live.call(install)
    try:
        yield seen
    finally:
        live.call(uninstall)


# --------------------------------------------------------------------------- basics


def test_public_endpoints(server, schemas):
    with httpx.Client(base_url=server.base_url) as http:
        assert http.get("/health").json() == {"status": "ok"}
        assert http.get("/version").json()["version"]
        models = assert_valid(schemas, "ListModelsResponse", http.get("/v1/models").json())
        assert [m["id"] for m in models["data"]] == [MODEL]
        assert models["data"][0]["quantization"] == "none"  # a dense checkpoint: no GGUF file
        assert assert_valid(schemas, "Model", http.get(f"/v1/models/{MODEL}").json())["id"] == MODEL
        missing = http.get("/v1/models/other")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        for method, path, status in (("GET", "/nope", 404), ("GET", "/v1/chat/completions", 405)):
            response = http.request(method, path)
            assert response.status_code == status
            assert_valid(schemas, "ErrorResponse", response.json())
        preflight = http.options(
            "/v1/chat/completions",
            headers={"Origin": "http://allowed.example", "Access-Control-Request-Method": "POST"},
        )
        assert preflight.headers["access-control-allow-origin"] == "http://allowed.example"


def test_metrics_read_the_engine(server):
    _client(server).chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)
    text = httpx.get(f"{server.base_url}/metrics").text
    label = f'{{model_name="{MODEL}"}}'
    assert f"specserve:num_requests_running{label} 0.0" in text
    assert f"specserve:num_requests_waiting{label} 0.0" in text
    assert f"specserve:kv_cache_usage_perc{label} 0.0" in text
    assert f"specserve:spec_decode_num_drafts_total{label} 0.0" in text


def test_chat_stream_equals_non_stream(server, schemas, tiny_chat_model):
    client = _client(server)
    kw = dict(model=MODEL, messages=HELLO, max_tokens=12, temperature=0)
    full = client.chat.completions.create(**kw, extra_body={"ignore_eos": True})
    assert_valid(schemas, "CreateChatCompletionResponse", full.model_dump(exclude_unset=True))
    stream = client.chat.completions.create(**kw, stream=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    )
    assert (
        [c.choices[0].finish_reason for c in chunks][-1]
        == full.choices[0].finish_reason
        == "length"
    )
    tokenizer = server.async_engine.engine.tokenizer
    assert full.usage.prompt_tokens == len(apply_chat_template(tokenizer, HELLO))
    assert full.usage.completion_tokens == 12
    assert full.usage.total_tokens == full.usage.prompt_tokens + 12


def test_completions_batch_stream_equals_non_stream(server, schemas):
    client = _client(server)
    prompts: Any
    for prompts in (["The sky is", "Once upon a time"], [[100, 200, 300], [400, 500]]):
        kw = dict(model=MODEL, prompt=prompts, max_tokens=6, temperature=0, n=2)
        full = client.completions.create(**kw)
        assert_valid(schemas, "CreateCompletionResponse", full.model_dump(exclude_unset=True))
        assert sorted(c.index for c in full.choices) == [0, 1, 2, 3]
        texts = {c.index: c.text for c in full.choices}
        assert texts[0] == texts[1] and texts[2] == texts[3]  # greedy: n copies agree
        streamed: dict[int, str] = {}
        finishes: dict[int, list[str]] = {}
        for chunk in client.completions.create(**kw, stream=True):
            for c in chunk.choices:
                streamed[c.index] = streamed.get(c.index, "") + c.text
                if c.finish_reason:
                    finishes.setdefault(c.index, []).append(c.finish_reason)
        assert streamed == texts
        assert finishes == {i: ["length"] for i in range(4)}
        assert full.usage.completion_tokens == 4 * 6


def test_raw_sse_matches_spec(server, schemas):
    body = _chat_body(n=2, stream=True, stream_options={"include_usage": True}, logprobs=True)
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.text.endswith("data: [DONE]\n\n")
    *chunks, done = _events(response)
    assert done == "[DONE]" and "[DONE]" not in chunks
    for chunk in chunks:
        assert_valid(schemas, "CreateChatCompletionStreamResponse", chunk)
    assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 16
    for index in (0, 1):
        mine = [ch for c in chunks for ch in c["choices"] if ch["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert [ch["finish_reason"] for ch in mine if ch["finish_reason"]] == ["length"]
        assert mine[-1]["finish_reason"] == "length"
        entries = [e for ch in mine if ch["logprobs"] for e in ch["logprobs"]["content"]]
        assert len(entries) == 8


def test_logprobs(server, schemas):
    client = _client(server)
    extra = {"ignore_eos": True, "skip_special_tokens": False}
    kw = dict(model=MODEL, messages=HELLO, max_tokens=10, temperature=0, extra_body=extra)
    full = client.chat.completions.create(**kw, logprobs=True, top_logprobs=3)
    assert_valid(schemas, "CreateChatCompletionResponse", full.model_dump(exclude_unset=True))
    content = full.choices[0].logprobs.content
    assert len(content) == 10
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob <= 0 and entry.token == entry.top_logprobs[0].token  # greedy
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-5)
    text = bytes(b for e in content for b in e.bytes).decode("utf-8", errors="replace")
    assert text == full.choices[0].message.content
    stream = client.chat.completions.create(**kw, logprobs=True, top_logprobs=3, stream=True)
    streamed = [
        e
        for c in stream
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [
        (e.token, round(e.logprob, 4)) for e in content
    ]
    legacy = client.completions.create(
        model=MODEL, prompt="Hi", max_tokens=5, logprobs=2, temperature=0
    )
    lp = legacy.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert all(len(top) >= 2 and max(top.values()) <= 0 for top in lp.top_logprobs)


def test_stop_strings(server):
    client = _client(server)
    kw = dict(model=MODEL, messages=HELLO, max_tokens=24, temperature=0)
    text = (
        client.chat.completions.create(**kw, extra_body={"ignore_eos": True})
        .choices[0]
        .message.content
    )
    assert len(text) >= 12, text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    expected = text[: text.index(stop)]
    cut = client.chat.completions.create(**kw, stop=[stop, "\x00never"])
    assert (cut.choices[0].message.content, cut.choices[0].finish_reason) == (expected, "stop")
    chunks = list(client.chat.completions.create(**kw, stop=stop, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["stop"]


def test_seed_determinism_and_n(server):
    client = _client(server)
    kw = dict(model=MODEL, messages=HELLO, max_tokens=10, temperature=1.0, n=3)
    first = client.chat.completions.create(**kw, seed=1234)
    again = client.chat.completions.create(**kw, seed=1234)
    other = client.chat.completions.create(**kw, seed=4321)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.message.content for c in again.choices] == texts
    assert [c.message.content for c in other.choices] != texts
    assert len(set(texts)) > 1  # the n samples differ from each other

    async def concurrent() -> list[str]:
        async with _async_client(server) as aclient:
            calls = [aclient.chat.completions.create(**kw, seed=1234) for _ in range(4)]
            return [r.choices[1].message.content for r in await asyncio.gather(*calls)]

    assert asyncio.run(concurrent()) == [texts[1]] * 4  # batching does not change a seeded sample


def test_async_streams_in_parallel(server):
    kw = dict(model=MODEL, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    prompts = [[{"role": "user", "content": f"Tell me about {i}"}] for i in range(6)]
    expected = [
        _client(server).chat.completions.create(messages=p, **kw).choices[0].message.content
        for p in prompts
    ]

    async def stream_all() -> list[str]:
        async with _async_client(server) as aclient:

            async def one(messages: Any) -> str:
                stream = await aclient.chat.completions.create(messages=messages, stream=True, **kw)
                return "".join([c.choices[0].delta.content or "" async for c in stream])

            return await asyncio.gather(*(one(p) for p in prompts))

    assert asyncio.run(stream_all()) == expected


# --------------------------------------------------------------------------- errors


def test_error_classes(server, guarded):
    client = _client(server)
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=HELLO)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=MAX_MODEL_LEN)
    assert "context" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=HELLO, n=1000)
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=[[49152]])
    for key in ("wrong-key", None):
        http = httpx.Client(base_url=guarded.base_url)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        response = http.post("/v1/chat/completions", json=_chat_body(GUARDED), headers=headers)
        assert (
            response.status_code == 401
            and response.json()["error"]["type"] == "authentication_error"
        )
    with pytest.raises(openai.AuthenticationError):
        _client(guarded, "wrong-key").models.list()
    assert _client(guarded, API_KEY).models.list().data[0].id == GUARDED


def test_api_key_checks_the_raw_path(guarded):
    with httpx.Client(base_url=guarded.base_url) as http:
        for path in ("/health", "/metrics", "/version"):
            assert http.get(path).status_code == 200
        # Only the exact public paths are public, whatever the Host header says.
        for path in ("/health/", "/v1/models", "/metrics/../v1/models"):
            assert http.get(path, headers={"Host": "localhost/health"}).status_code == 401
        good = {"Authorization": f"Bearer {API_KEY}"}
        assert http.get("/v1/models", headers=good).status_code == 200


def _bad_inputs() -> list[tuple[str, str, Any, int]]:
    """(id, endpoint, body: dict / bytes / (bytes, content-type), status)."""
    chat, comp = "/v1/chat/completions", "/v1/completions"
    c = _chat_body()
    p = {"model": MODEL, "prompt": "Hi", "max_tokens": 4}

    def cp(**patch: Any) -> dict[str, Any]:
        return {**c, **patch}

    def msg(m: Any) -> dict[str, Any]:
        return cp(messages=[m])

    return [
        ("truncated-json", chat, b'{"model":', 400),
        ("trailing-garbage", chat, b"{} x", 400),
        ("empty-body", chat, b"", 400),
        ("not-utf8", chat, b"\xff\xfe{}", 400),
        ("array-body", chat, b"[]", 400),
        ("string-body", chat, b'"hi"', 400),
        ("null-body", chat, b"null", 400),
        ("nan", chat, json.dumps(c)[:-1].encode() + b', "temperature": NaN}', 400),
        ("text-plain", chat, (json.dumps(c).encode(), "text/plain"), 400),
        ("form", chat, (b"model=x", "application/x-www-form-urlencoded"), 400),
        ("no-messages", chat, {"model": MODEL}, 400),
        ("empty-messages", chat, cp(messages=[]), 400),
        ("messages-string", chat, cp(messages="hi"), 400),
        ("message-string", chat, cp(messages=["hi"]), 400),
        ("no-role", chat, msg({"content": "hi"}), 400),
        ("unknown-role", chat, msg({"role": "robot", "content": "hi"}), 400),
        ("tool-role", chat, msg({"role": "tool", "content": "hi", "tool_call_id": "x"}), 400),
        ("null-content", chat, msg({"role": "user", "content": None}), 400),
        ("number-content", chat, msg({"role": "user", "content": 5}), 400),
        ("image-part", chat, msg({"role": "user", "content": [{"type": "image_url"}]}), 400),
        ("no-model", chat, {"messages": HELLO}, 400),
        ("model-number", chat, cp(model=123), 400),
        ("unknown-model", chat, cp(model="gpt-4o"), 404),
        ("max-tokens-string", chat, cp(max_tokens="4"), 400),
        ("max-tokens-float", chat, cp(max_tokens=4.0), 400),
        ("max-tokens-zero", chat, cp(max_tokens=0), 400),
        ("max-tokens-negative", chat, cp(max_tokens=-1), 400),
        ("max-tokens-huge", chat, cp(max_tokens=10**9), 400),
        ("max-completion-beyond-context", chat, cp(max_completion_tokens=MAX_MODEL_LEN), 400),
        ("temperature-high", chat, cp(temperature=3), 400),
        ("temperature-string", chat, cp(temperature="hot"), 400),
        ("top-p-high", chat, cp(top_p=1.5), 400),
        ("n-zero", chat, cp(n=0), 400),
        ("n-huge", chat, cp(n=1000), 400),
        ("n-bool", chat, cp(n=True), 400),
        ("logprobs-string", chat, cp(logprobs="yes"), 400),
        ("top-logprobs-huge", chat, cp(logprobs=True, top_logprobs=21), 400),
        ("top-logprobs-alone", chat, cp(top_logprobs=2), 400),
        ("seed-beyond-64-bits", chat, cp(seed=2**64), 400),
        ("seed-below-int64", chat, cp(seed=-(2**63) - 1), 400),
        ("too-many-stops", chat, cp(stop=["a", "b", "c", "d", "e"]), 400),
        ("stop-number", chat, cp(stop=[1]), 400),
        ("penalty-high", chat, cp(presence_penalty=3), 400),
        ("logit-bias-key", chat, cp(logit_bias={"abc": 1}), 400),
        ("logit-bias-vocab", chat, cp(logit_bias={"999999": 1}), 400),
        ("stream-string", chat, cp(stream="yes"), 400),
        ("stream-options-alone", chat, cp(stream_options={"include_usage": True}), 400),
        ("tools", chat, cp(tools=[{"type": "function", "function": {"name": "f"}}]), 400),
        ("json-mode", chat, cp(response_format={"type": "json_object"}), 400),
        ("prompt-too-long", chat, msg({"role": "user", "content": "word " * 600}), 400),
        (
            "stream-prompt-too-long",
            chat,
            cp(messages=[{"role": "user", "content": "a " * 600}], stream=True),
            400,
        ),
        ("oversized-body", chat, msg({"role": "user", "content": "x" * (MAX_BODY + 1)}), 413),
        ("empty-prompt", comp, {**p, "prompt": ""}, 400),
        ("empty-prompt-list", comp, {**p, "prompt": []}, 400),
        ("token-out-of-vocab", comp, {**p, "prompt": [[49152]]}, 400),
        ("token-negative", comp, {**p, "prompt": [-1, 5]}, 400),
        ("tokens-too-long", comp, {**p, "prompt": [7] * (MAX_MODEL_LEN + 1)}, 400),
        ("second-prompt-too-long", comp, {**p, "prompt": [[7, 8], [7] * MAX_MODEL_LEN]}, 400),
        ("mixed-prompts", comp, {**p, "prompt": ["a", [1, 2]]}, 400),
        ("legacy-logprobs-huge", comp, {**p, "logprobs": 6}, 400),
        ("echo", comp, {**p, "echo": True}, 400),
        ("completion-unknown-model", comp, {**p, "model": "davinci"}, 404),
    ]


BAD_INPUTS = _bad_inputs()


def test_bad_inputs_get_an_envelope_and_the_server_keeps_serving(server, schemas):
    assert len(BAD_INPUTS) >= 40 and len({case[0] for case in BAD_INPUTS}) == len(BAD_INPUTS)
    failures = []
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        for name, path, body, status in BAD_INPUTS:
            if isinstance(body, dict):
                response = http.post(path, json=body)
            else:
                content, kind = body if isinstance(body, tuple) else (body, "application/json")
                response = http.post(path, content=content, headers={"Content-Type": kind})
            error = response.json().get("error") if response.content else None
            if response.status_code != status or not error or not error.get("message"):
                failures.append((name, response.status_code, response.text[:200]))
                continue
            assert_valid(schemas, "ErrorResponse", response.json())
            assert error["type"] == "invalid_request_error", name
        assert not failures, failures
        chunked = http.post(path, content=iter([b"x" * 65536] * 5))  # no Content-Length
        assert chunked.status_code == 413 and chunked.json()["error"]["code"] == "request_too_large"
        # Unknown fields are tolerated (and logged).
        good = http.post("/v1/chat/completions", json=_chat_body(not_a_field=1, metadata={}))
        assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] >= 1
    assert wait_idle(server) == IDLE


def test_overload_is_429_with_retry_after(guarded):
    num_requests = 12

    async def burst() -> list[Any]:
        async with _async_client(guarded, API_KEY) as aclient:
            calls = [
                aclient.chat.completions.create(
                    model=GUARDED, messages=HELLO, max_tokens=100, extra_body={"ignore_eos": True}
                )
                for _ in range(num_requests)
            ]
            return await asyncio.gather(*calls, return_exceptions=True)

    results = asyncio.run(burst())
    limited = [r for r in results if isinstance(r, openai.RateLimitError)]
    served = [r for r in results if not isinstance(r, BaseException)]
    assert len(limited) + len(served) == num_requests, results
    assert limited and served
    for error in limited:
        assert int(error.response.headers["retry-after"]) >= 1
        assert error.response.headers["x-should-retry"] == "true"
        assert error.body["type"] == "server_error"
    assert all(r.usage.completion_tokens == 100 for r in served)
    assert wait_idle(guarded) == IDLE
    assert httpx.get(f"{guarded.base_url}/health").status_code == 200


def test_one_token_per_chunk_under_speculation(guarded):
    client = _client(guarded, API_KEY)
    kw = dict(model=GUARDED, messages=HELLO, max_tokens=24, temperature=0)
    extra = {"ignore_eos": True}
    text = client.chat.completions.create(**kw, extra_body=extra).choices[0].message.content
    stream = client.chat.completions.create(
        **kw,
        extra_body=extra,
        prediction={"type": "content", "content": text},
        logprobs=True,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    usage = chunks[-1].usage
    # The prediction is right, so steps verify several tokens: yet each chunk carries one.
    assert usage.completion_tokens_details.accepted_prediction_tokens > 0
    per_chunk = [
        len(c.choices[0].logprobs.content) for c in chunks if c.choices and c.choices[0].logprobs
    ]
    assert per_chunk == [1] * 24
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    metrics = httpx.get(f"{guarded.base_url}/metrics").text
    accepted = next(
        line
        for line in metrics.splitlines()
        if line.startswith("specserve:spec_decode_num_accepted_tokens_total")
    )
    assert (
        float(accepted.rsplit(" ", 1)[1])
        >= usage.completion_tokens_details.accepted_prediction_tokens
    )


def test_internal_errors_hide_their_text(server):
    """A failure inside the server is a 500 (or an error event) with a fixed message."""
    tokens, server.app.state.tokens = server.app.state.tokens, None  # breaks logprobs
    try:
        body = _chat_body(logprobs=True)
        response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body)
        assert response.status_code == 500
        error = response.json()["error"]
        assert error["type"] == "server_error" and "NoneType" not in response.text
        streamed = httpx.post(
            f"{server.base_url}/v1/chat/completions", json={**body, "stream": True}
        )
        *_, failure, done = _events(streamed)
        assert done == "[DONE]" and failure["error"]["type"] == "server_error"
        assert failure["error"]["message"].startswith(error["message"][:-1])  # + the request id
        assert "NoneType" not in streamed.text
    finally:
        server.app.state.tokens = tokens
    assert wait_idle(server) == IDLE


# --------------------------------------------------------------------------- disconnects


def test_cancelled_streams_abort_their_requests(server):
    num_streams = 50
    body = {**_chat_body(max_tokens=400, stream=True), "ignore_eos": True}

    async def one(http: httpx.AsyncClient, i: int) -> None:
        if i % 2:  # give up whatever state the request is in: waiting, prefill or streaming
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.2 + 0.01 * i):
                    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                        async for _ in r.aiter_lines():
                            pass
            return
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            lines = 0
            async for line in response.aiter_lines():
                lines += bool(line)
                if lines == 2:  # the role chunk and one token: mid-generation
                    break

    async def run_all() -> None:
        limits = httpx.Limits(max_connections=num_streams)
        async with httpx.AsyncClient(base_url=server.base_url, limits=limits, timeout=60) as http:
            await asyncio.gather(*(one(http, i) for i in range(num_streams)))

    with _tracked(server) as seen:
        asyncio.run(run_all())
        state = wait_idle(server)
    assert state == IDLE
    # The 25 that read a token reached the engine; a client that gave up sooner may have left
    # before its request did (how many depends on the machine's load), and then none is made.
    assert num_streams // 2 <= len(seen["added"]) <= num_streams
    assert sorted(seen["aborted"]) == sorted(seen["added"])  # none ran to its 400 tokens
    after = _client(server).chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4)
    assert after.usage.completion_tokens == 4


def test_non_streaming_disconnect_aborts(server):
    body = {**_chat_body(max_tokens=460), "ignore_eos": True}
    with _tracked(server) as seen:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=0.3)
        state = wait_idle(server)
    assert state == IDLE
    assert len(seen["added"]) == 1 and seen["aborted"] == seen["added"]


# --------------------------------------------------------------------------- lifecycle


def test_dead_or_failed_engine_is_503(tiny_chat_model):
    with live_server(create_app(_settings(tiny_chat_model))) as live:
        asyncio.run(live.async_engine.shutdown(timeout=0))
        health = httpx.get(f"{live.base_url}/health")
        assert (health.status_code, health.json()) == (503, {"status": "unavailable"})
        with pytest.raises(openai.InternalServerError) as e:
            _client(live).chat.completions.create(model=MODEL, messages=HELLO)
        assert e.value.status_code == 503 and e.value.response.headers["retry-after"]
    with live_server(create_app(_settings(tiny_chat_model.parent / "missing")), wait=False) as live:
        deadline = time.monotonic() + 20
        while httpx.get(f"{live.base_url}/health").json()["status"] == "loading":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        health = httpx.get(f"{live.base_url}/health")
        assert (health.status_code, health.json()) == (503, {"status": "failed"})


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _serve_in_process(config: Path, port: int, env: dict[str, str]) -> subprocess.Popen:
    command = [sys.executable, "-m", "server.cli", "serve", "--config", str(config)]
    return subprocess.Popen(
        [*command, "--port", str(port), "--log-level", "warning"],
        env=env,
        cwd=Path(__file__).resolve().parents[2],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def _stream_through_sigterm(process: subprocess.Popen, base: str, body: dict) -> list[str]:
    """The events of a stream that is in flight when the server gets SIGTERM; checks that the
    server then exits by itself and prints no traceback."""
    started, result = threading.Event(), {}

    def read() -> None:
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=120) as r:
            lines = []
            for line in r.iter_lines():
                lines.append(line)
                started.set()
            result["text"] = "\n".join(lines)

    reader = threading.Thread(target=read)
    reader.start()
    assert started.wait(30)
    process.send_signal(signal.SIGTERM)
    reader.join(120)
    # uvicorn re-raises the SIGTERM it caught once its shutdown is complete.
    assert process.wait(120) in (0, -signal.SIGTERM)
    assert process.stderr is not None and "Traceback" not in process.stderr.read().decode()
    return [line[6:] for line in result["text"].splitlines() if line]


def test_cli_serve_settings_and_graceful_sigterm(tiny_chat_model, tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "engine": {"model": str(tiny_chat_model), "dtype": "float32", "max_model_len": 512},
                "server": {"served_model_name": "from-yaml", "port": 1, "shutdown_timeout": 20},
            }
        )
    )
    port = _free_port()
    env = {**os.environ, "SPECSERVE_SERVED_MODEL_NAME": "from-env", "SPECSERVE_PORT": "2"}
    process = _serve_in_process(config, port, env)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base)
        assert httpx.get(f"{base}/v1/models").json()["data"][0]["id"] == "from-env"
        # A long stream is in flight when SIGTERM arrives: it is drained, not cut (on a machine
        # too loaded to finish 300 tokens of a tiny model in 20 s it is cut, and ends cleanly).
        body = {**_chat_body("from-env", max_tokens=300, stream=True), "ignore_eos": True}
        events = _stream_through_sigterm(process, base, body)
        assert events[-1] == "[DONE]"
        tokens = [
            e
            for e in events[:-1]
            if json.loads(e).get("choices", [{}])[0].get("delta", {}).get("content")
        ]
        assert tokens
        last = json.loads(events[-2])
        if "error" not in last:
            assert last["choices"][0]["finish_reason"] == "length"
        else:
            assert last["error"]["code"] == "aborted"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_cli_serve_ends_the_streams_it_cuts_at_the_shutdown_timeout(tiny_chat_model, tmp_path):
    # shutdown_timeout 0: what is in flight at SIGTERM is aborted at once. Its stream still ends
    # as an OpenAI stream does when the server fails it (an error event, then [DONE]), before
    # uvicorn's own deadline cuts the connection, and the server prints no traceback.
    config = tmp_path / "serve.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "engine": {
                    "model": str(tiny_chat_model),
                    "dtype": "float32",
                    "max_model_len": 1024,
                },
                "server": {"served_model_name": "cut", "shutdown_timeout": 0},
            }
        )
    )
    port = _free_port()
    process = _serve_in_process(config, port, dict(os.environ))
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base)
        body = {**_chat_body("cut", max_tokens=900, stream=True), "ignore_eos": True}
        events = _stream_through_sigterm(process, base, body)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "aborted" and error["type"] == "server_error"
        chunks = [json.loads(e) for e in events[:-2]]
        assert chunks and all(c["object"] == "chat.completion.chunk" for c in chunks)
        assert sum(len(c["choices"][0]["delta"].get("content") or "") > 0 for c in chunks) < 900
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_cli_serve_exits_when_the_model_does_not_load(tmp_path):
    process = subprocess.run(
        [sys.executable, "-m", "server.cli", "serve", "--model", str(tmp_path / "missing")],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "SPECSERVE_PORT": str(_free_port())},
    )
    assert process.returncode == 1
    assert "the engine failed to load" in process.stderr
