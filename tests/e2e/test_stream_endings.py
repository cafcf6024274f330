"""Every stream the server cuts ends cleanly: an OpenAI error event, then `data: [DONE]`, and no
traceback from the HTTP layer. The engine loop dying mid-stream is tested here; the shutdown
timeout in test_server.py (test_cli_serve_ends_the_streams_it_cuts_at_the_shutdown_timeout) and
a client that stops reading in test_slow_clients.py."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import httpx

from engine.engine import LLMEngine
from server.app import create_app
from tests.e2e.conftest import live_server, tiny_settings

MODEL = "tiny-endings"


def _die_at_the_next_step(engine: LLMEngine) -> None:
    def step() -> None:
        raise RuntimeError("the engine broke")

    engine.step = step  # type: ignore[method-assign]


def test_a_stream_whose_engine_dies_ends_with_an_error_event_then_done(
    tiny_chat_model: Path, caplog
):
    settings = tiny_settings(tiny_chat_model, MODEL, log_stats_interval=0)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    events: list[str] = []
    with caplog.at_level(logging.INFO), live_server(create_app(settings)) as live:
        url = f"{live.base_url}/v1/chat/completions"
        with httpx.stream("POST", url, json=body, timeout=60) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if not line:
                    continue
                events.append(line.removeprefix("data: "))
                if len(events) == 2:  # the role chunk and a token: mid-generation
                    live.call(_die_at_the_next_step)
        health = httpx.get(f"{live.base_url}/health")
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    error = json.loads(events[-2])["error"]
    assert (error["type"], error["code"]) == ("server_error", "engine_unavailable")
    assert "broke" not in events[-2]  # no internals in what the client sees
    chunks = [json.loads(event) for event in events[:-2]]
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
    assert len(chunks) < 400 and health.status_code == 503
    # The engine's own death is logged with its exception; the HTTP layer logs no traceback.
    tracebacks = [r for r in caplog.records if r.exc_info and r.name != "server.async_engine"]
    assert not tracebacks, [(r.name, r.getMessage()) for r in tracebacks]
    assert any(r.name == "server.async_engine" and r.exc_info for r in caplog.records)
