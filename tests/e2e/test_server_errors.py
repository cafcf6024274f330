"""The HTTP server end to end, what a malformed request or a failure inside gets: an OpenAI error
envelope checked against the official OpenAPI spec, a fixed message for internal errors, and a
server that keeps serving. The server is the package's shared `server` (tests/e2e/conftest.py).
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import IDLE, wait_idle
from tests.e2e.server_helpers import (
    HELLO,
    MAX_BODY,
    MAX_MODEL_LEN,
    MODEL,
    chat_body,
    sse_events,
)
from tests.openapi_spec import assert_valid

pytest.importorskip("jsonschema")


def _bad_inputs() -> list[tuple[str, str, Any, int]]:
    """(id, endpoint, body: dict / bytes / (bytes, content-type), status)."""
    chat, comp = "/v1/chat/completions", "/v1/completions"
    c = chat_body()
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
        ("function-role", chat, msg({"role": "function", "name": "f", "content": "hi"}), 400),
        ("tool-role-without-call-id", chat, msg({"role": "tool", "content": "hi"}), 400),
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
        ("json-schema-without-schema", chat, cp(response_format={"type": "json_schema"}), 400),
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
        good = http.post("/v1/chat/completions", json=chat_body(not_a_field=1, metadata={}))
        assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] >= 1
    assert wait_idle(server) == IDLE


def test_internal_errors_hide_their_text(server):
    """A failure inside the server is a 500 (or an error event) with a fixed message."""
    lifecycle, serving = server.state.lifecycle, server.serving
    lifecycle.serving = replace(serving, token_decoder=None)  # breaks logprobs
    try:
        body = chat_body(logprobs=True)
        response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body)
        assert response.status_code == 500
        error = response.json()["error"]
        assert error["type"] == "server_error" and "NoneType" not in response.text
        streamed = httpx.post(
            f"{server.base_url}/v1/chat/completions", json={**body, "stream": True}
        )
        *_, failure, done = sse_events(streamed)
        assert done == "[DONE]" and failure["error"]["type"] == "server_error"
        assert failure["error"]["message"].startswith(error["message"][:-1])  # + the request id
        assert "NoneType" not in streamed.text
    finally:
        lifecycle.serving = serving
    assert wait_idle(server) == IDLE
