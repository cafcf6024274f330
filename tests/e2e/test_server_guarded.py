"""The HTTP server end to end behind its guards: the error classes the `openai` client raises,
the API key, a full queue's 429, and one SSE chunk per token while speculation verifies several.

Server `guarded`: an API key, a queue of 2 with one sequence at a time, one SSE chunk per token,
and speculation from the request's `prediction` (so steps yield several tokens); its engine is
built by the caller rather than the app's lifespan. The error classes are also checked on the
package's shared `server` (tests/e2e/conftest.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from engine.engine import LLMEngine
from server.app import create_app
from server.async_engine import AsyncEngine
from tests.e2e.conftest import IDLE, LiveServer, live_server, wait_idle
from tests.e2e.server_helpers import (
    API_KEY,
    GUARDED,
    HELLO,
    MAX_MODEL_LEN,
    MODEL,
    async_openai_client,
    chat_body,
    openai_client,
    server_settings,
)


@pytest.fixture(scope="module")
def guarded(tiny_chat_model) -> Iterator[LiveServer]:
    settings = server_settings(
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


def test_error_classes(server, guarded):
    client = openai_client(server)
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
        response = http.post("/v1/chat/completions", json=chat_body(GUARDED), headers=headers)
        assert (
            response.status_code == 401
            and response.json()["error"]["type"] == "authentication_error"
        )
    with pytest.raises(openai.AuthenticationError):
        openai_client(guarded, "wrong-key").models.list()
    assert openai_client(guarded, API_KEY).models.list().data[0].id == GUARDED


def test_api_key_checks_the_raw_path(guarded):
    with httpx.Client(base_url=guarded.base_url) as http:
        for path in ("/health", "/metrics", "/version"):
            assert http.get(path).status_code == 200
        # Only the exact public paths are public, whatever the Host header says.
        for path in ("/health/", "/v1/models", "/metrics/../v1/models"):
            assert http.get(path, headers={"Host": "localhost/health"}).status_code == 401
        good = {"Authorization": f"Bearer {API_KEY}"}
        assert http.get("/v1/models", headers=good).status_code == 200


def test_overload_is_429_with_retry_after(guarded):
    num_requests = 12

    async def burst() -> list[Any]:
        async with async_openai_client(guarded, API_KEY) as aclient:
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
    client = openai_client(guarded, API_KEY)
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
