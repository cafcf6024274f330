"""The HTTP server end to end when clients go away: a stream cancelled in any state, or a
non-streaming request whose client times out, aborts its engine request and leaves the engine idle.
The server is the package's shared `server` (tests/e2e/conftest.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from engine.engine import LLMEngine
from tests.e2e.conftest import IDLE, LiveServer, wait_idle
from tests.e2e.server_helpers import HELLO, MODEL, chat_body, openai_client


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


def test_cancelled_streams_abort_their_requests(server):
    num_streams = 50
    body = {**chat_body(max_tokens=400, stream=True), "ignore_eos": True}

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
    after = openai_client(server).chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4)
    assert after.usage.completion_tokens == 4


def test_non_streaming_disconnect_aborts(server):
    body = {**chat_body(max_tokens=460), "ignore_eos": True}
    with _tracked(server) as seen:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=0.3)
        state = wait_idle(server)
    assert state == IDLE
    assert len(seen["added"]) == 1 and seen["aborted"] == seen["added"]
