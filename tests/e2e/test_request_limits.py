"""Against a real server: /v1/completions' max_tokens null is 16, and the per-request bounds
(server settings) turn a request that would fan out into too many sequences or ask for too many
tokens into a 400 envelope before anything reaches the engine."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from server.app import create_app
from tests.e2e.conftest import IDLE, LiveServer, live_server, tiny_settings, wait_idle

MODEL = "tiny-limits"
CONTEXT = 512  # tiny_settings' max_model_len
HELLO = [{"role": "user", "content": "Hello there, how are you?"}]


@pytest.fixture(scope="module")
def server(tiny_chat_model: Path) -> Iterator[LiveServer]:
    settings = tiny_settings(
        tiny_chat_model, MODEL, max_tokens_per_request=300, max_sequences_per_request=8
    )
    with live_server(create_app(settings)) as live:
        yield live


def _post(live: LiveServer, path: str, **body: Any) -> httpx.Response:
    return httpx.post(f"{live.base_url}{path}", json={"model": MODEL, **body}, timeout=60)


def _error(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 400, response.text
    return response.json()["error"]


def test_completions_max_tokens_null_is_16(server):
    body = {"prompt": "Once upon a time", "ignore_eos": True, "temperature": 0}
    explicit = _post(server, "/v1/completions", **body, max_tokens=None).json()
    absent = _post(server, "/v1/completions", **body).json()
    assert explicit["usage"]["completion_tokens"] == absent["usage"]["completion_tokens"] == 16
    assert explicit["choices"][0]["finish_reason"] == "length"


def test_fan_out_and_token_bounds_are_400_before_the_engine(server):
    before = server.call(lambda engine: engine.metrics.num_prompt_tokens)
    fan_out = _error(_post(server, "/v1/completions", prompt=["a"] * 64, n=16))
    assert fan_out["param"] == "n" and "max_sequences_per_request" in fan_out["message"]
    assert fan_out["type"] == "invalid_request_error"
    tokens = _error(_post(server, "/v1/completions", prompt=["a"] * 4, n=2, max_tokens=40))
    assert tokens["param"] == "max_tokens" and "320 tokens" in tokens["message"]
    assert "max_tokens_per_request" in tokens["message"]
    # A chat request without max_tokens counts the context left after its (templated) prompt.
    chat = _error(_post(server, "/v1/chat/completions", messages=HELLO))
    assert chat["param"] == "max_tokens" and "context left" in chat["message"]
    given = _error(
        _post(server, "/v1/chat/completions", messages=HELLO, n=4, max_completion_tokens=80)
    )
    assert given["param"] == "max_completion_tokens"
    assert server.call(lambda engine: engine.metrics.num_prompt_tokens) == before
    # Within the bounds, the same requests are served.
    ok = _post(server, "/v1/completions", prompt=["a"] * 4, n=2, max_tokens=30, ignore_eos=True)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 240
    assert wait_idle(server) == IDLE


def test_default_bounds_let_a_normal_chat_through(tiny_chat_model):
    # n up to 8 and no max_tokens: 8 sequences that may each run to the end of the context.
    with live_server(create_app(tiny_settings(tiny_chat_model, MODEL))) as live:
        response = _post(live, "/v1/chat/completions", messages=HELLO, n=8, temperature=1)
        assert response.status_code == 200 and len(response.json()["choices"]) == 8
        too_many = _post(live, "/v1/completions", prompt=["a"] * 64, n=16)
        assert _error(too_many)["param"] == "n"
        assert wait_idle(live) == IDLE
