"""The connection bounds' wiring and the body middleware's contract, without a server: the CLI's
uvicorn config carries the settings' timeouts, and the body's deadline ends with the body."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from server.app import create_app
from server.cli import build_parser
from server.connections import TimedH11Protocol, uvicorn_config
from server.errors import OpenAIError
from server.middleware import BodyLimitMiddleware
from server.settings import load_settings
from server.state import server_state


def test_cli_settings_reach_the_uvicorn_protocol():
    flags = ["--header-timeout", "1.5", "--stream-stall-timeout", "2", "--body-timeout", "3"]
    args = build_parser().parse_args(["serve", "--model", "m", *flags])
    settings = load_settings(None, args, environ={})
    assert (settings.body_timeout, settings.max_drained_body_bytes) == (3.0, 64 << 20)

    app = create_app(settings)  # builds its state; nothing loads before its lifespan starts
    config = uvicorn_config(app, settings, port=0)
    assert issubclass(config.http, TimedH11Protocol)
    assert (config.http.header_timeout, config.http.stall_timeout) == (1.5, 2.0)
    assert config.http.counters is server_state(app).counters
    with pytest.raises(ValueError, match="stream_stall_timeout"):
        load_settings(None, {"model": "m", "stream_stall_timeout": 0}, environ={})


def _scope(**headers: str) -> dict[str, Any]:
    raw = [(name.replace("_", "-").encode(), value.encode()) for name, value in headers.items()]
    return {"type": "http", "method": "POST", "path": "/", "headers": raw}


def test_the_body_deadline_ends_with_the_body():
    """Past the body's deadline, a complete body's receive (a stream waiting for the client's
    disconnect) is passed through; an incomplete one is a 408."""

    async def main() -> tuple[list[str], OpenAIError]:
        messages = [
            {"type": "http.request", "body": b"{}", "more_body": False},
            {"type": "http.disconnect"},
        ]
        seen: list[str] = []

        async def receive() -> dict[str, Any]:
            if not messages:
                await asyncio.sleep(60)  # a body that never comes
            return messages.pop(0)

        async def app(scope: Any, receive: Any, send: Any) -> None:
            seen.append((await receive())["type"])
            await asyncio.sleep(0.1)  # past the deadline
            seen.append((await receive())["type"])
            with pytest.raises(OpenAIError) as info:
                await BodyLimitMiddleware(probe, 100, 0.05, 0)(_scope(), receive, send)
            raise info.value

        async def probe(scope: Any, receive: Any, send: Any) -> None:
            await receive()

        try:
            await BodyLimitMiddleware(app, 100, 0.05, 0)(_scope(), receive, _no_send)
        except OpenAIError as e:
            return seen, e
        raise AssertionError("no 408")

    seen, error = asyncio.run(main())
    assert seen == ["http.request", "http.disconnect"]
    assert (error.status, error.code, error.headers) == (
        408,
        "request_timeout",
        {"Connection": "close"},
    )


async def _no_send(message: Any) -> None:
    raise AssertionError(f"nothing is sent here: {message}")
