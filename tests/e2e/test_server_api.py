"""The HTTP server end to end, what a well-formed request gets: public endpoints, chat and
completions (streamed and not), raw SSE, logprobs, stop strings, seeds and parallel streams, through
the official `openai` client (sync and async) and raw httpx. Every body and chunk is checked
against the official OpenAPI spec.

The server is the package's shared `server` (tests/e2e/conftest.py): default settings, the engine
loaded by the app's lifespan, a tiny random-weight Llama with SmolLM2's tokenizer.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from engine.text.tokenizer import apply_chat_template
from tests.e2e.server_helpers import (
    HELLO,
    MODEL,
    async_openai_client,
    chat_body,
    openai_client,
    sse_events,
)
from tests.openapi_spec import assert_valid

pytest.importorskip("jsonschema")


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
    openai_client(server).chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)
    text = httpx.get(f"{server.base_url}/metrics").text
    label = f'{{model_name="{MODEL}"}}'
    assert f"specserve:num_requests_running{label} 0.0" in text
    assert f"specserve:num_requests_waiting{label} 0.0" in text
    assert f"specserve:kv_cache_usage_perc{label} 0.0" in text
    assert f"specserve:spec_decode_num_drafts_total{label} 0.0" in text


def test_chat_stream_equals_non_stream(server, schemas, tiny_chat_model):
    client = openai_client(server)
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
    client = openai_client(server)
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
    body = chat_body(n=2, stream=True, stream_options={"include_usage": True}, logprobs=True)
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.text.endswith("data: [DONE]\n\n")
    *chunks, done = sse_events(response)
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
    client = openai_client(server)
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
    client = openai_client(server)
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
    client = openai_client(server)
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
        async with async_openai_client(server) as aclient:
            calls = [aclient.chat.completions.create(**kw, seed=1234) for _ in range(4)]
            return [r.choices[1].message.content for r in await asyncio.gather(*calls)]

    assert asyncio.run(concurrent()) == [texts[1]] * 4  # batching does not change a seeded sample


def test_async_streams_in_parallel(server):
    kw = dict(model=MODEL, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    prompts = [[{"role": "user", "content": f"Tell me about {i}"}] for i in range(6)]
    expected = [
        openai_client(server).chat.completions.create(messages=p, **kw).choices[0].message.content
        for p in prompts
    ]

    async def stream_all() -> list[str]:
        async with async_openai_client(server) as aclient:

            async def one(messages: Any) -> str:
                stream = await aclient.chat.completions.create(messages=messages, stream=True, **kw)
                return "".join([c.choices[0].delta.content or "" async for c in stream])

            return await asyncio.gather(*(one(p) for p in prompts))

    assert asyncio.run(stream_all()) == expected
