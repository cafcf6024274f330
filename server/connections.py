"""The HTTP connection layer: uvicorn's h11 protocol with the timeouts uvicorn does not have.

- `header_timeout`: once a connection opens, and again once a response ends (the next request's
  turn), the request line and headers must arrive within it, else the connection is closed.
  uvicorn's keep-alive timeout only covers a silent connection: every byte restarts it, so a
  client sending its headers a byte at a time would hold the connection forever. The timer also
  bounds the rest of a body the app answered without reading (uvicorn reads and drops it).
- `stream_stall_timeout`: while the transport's write buffer is over its high-water mark
  (uvicorn's `send` then waits for it to drain: the client is not reading), the client must read
  within it, else the connection is aborted without flushing what it would not read. The app
  sees the client's disconnect, so its engine requests are aborted and their KV blocks freed;
  `ServerCounters.num_stream_stalls` counts it (`specserve:stream_stalls_total`).

The time to receive a body is bounded in the ASGI layer (`server/middleware.py`, BodyLimitMiddleware),
which can still answer 408. `uvicorn_config` is how the CLI (and the end-to-end tests) configure
uvicorn with these.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import uvicorn
from starlette.applications import Starlette
from uvicorn.protocols.http.h11_impl import H11Protocol

from server.metrics import ServerCounters
from server.settings import Settings
from server.state import server_state

logger = logging.getLogger(__name__)


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header timeout and a stall timeout (see the module doc);
    `timed_protocol` makes a subclass with the values set."""

    header_timeout: float = 30.0
    stall_timeout: float = 30.0
    counters: ServerCounters | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._stall_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[arg-type]
        self._header_timer = self._later(self._header_timer, self.header_timeout, self._no_headers)

    def connection_lost(self, exc: Exception | None) -> None:
        self._header_timer = self._cancel(self._header_timer)
        self._stall_timer = self._cancel(self._stall_timer)
        super().connection_lost(exc)

    def handle_events(self) -> None:
        headers = self.headers
        super().handle_events()
        if self.headers is not headers:  # a request line and its headers arrived
            self._header_timer = self._cancel(self._header_timer)

    def on_response_complete(self) -> None:
        if not self.transport.is_closing():
            self._header_timer = self._later(
                self._header_timer, self.header_timeout, self._no_headers
            )
        super().on_response_complete()  # may start a pipelined request: handle_events cancels

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall_timer is None:
            self._stall_timer = self._later(None, self.stall_timeout, self._stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._stall_timer = self._cancel(self._stall_timer)

    def _no_headers(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            logger.debug(
                "closing %s: no request headers in %.1f s", self.client, self.header_timeout
            )
            self.transport.close()

    def _stalled(self) -> None:
        self._stall_timer = None
        logger.info(
            "client %s read nothing for %.1f s: its response is cut and its requests aborted",
            self.client,
            self.stall_timeout,
        )
        if self.counters is not None:
            self.counters.num_stream_stalls += 1
        self.transport.abort()  # close() would wait to flush what the client does not read

    def _later(
        self, timer: asyncio.TimerHandle | None, delay: float, callback: Callable[[], None]
    ) -> asyncio.TimerHandle:
        self._cancel(timer)
        return self.loop.call_later(delay, callback)

    @staticmethod
    def _cancel(timer: asyncio.TimerHandle | None) -> None:
        if timer is not None:
            timer.cancel()


def timed_protocol(
    header_timeout: float, stall_timeout: float, counters: ServerCounters | None
) -> type[TimedH11Protocol]:
    """A `TimedH11Protocol` class with these values (uvicorn builds one per connection)."""
    attrs = {
        "header_timeout": header_timeout,
        "stall_timeout": stall_timeout,
        "counters": counters,
    }
    return type("SpecserveH11Protocol", (TimedH11Protocol,), attrs)


def uvicorn_config(app: Starlette, settings: Settings, **options: Any) -> uvicorn.Config:
    """uvicorn's configuration for `app` (built by `create_app(settings)`): the h11 protocol with
    the settings' header and stall timeouts, counting into the app's server counters; `options`
    are uvicorn.Config's own."""
    counters = server_state(app).counters
    protocol = timed_protocol(settings.header_timeout, settings.stream_stall_timeout, counters)
    return uvicorn.Config(app, http=protocol, **options)
