"""The ASGI middleware every request passes first: the API key, and the bounds of a body (its
size and the time it takes to arrive); and the JSON response an OpenAIError becomes."""

from __future__ import annotations

import asyncio
import contextlib
import hmac

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import (
    OpenAIError,
    authentication_error,
    invalid_request,
    request_timeout,
    request_too_large,
)

# Paths served without the API key: probes and scrapes.
PUBLIC_PATHS = frozenset({"/health", "/metrics", "/version"})


def error_response(error: OpenAIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


class ApiKeyMiddleware:
    """Requires `Authorization: Bearer <api_key>` on every path but the public ones."""

    def __init__(self, app: ASGIApp, api_key: str, public_paths: frozenset[str] = PUBLIC_PATHS):
        self.app = app
        self._key = api_key.encode()
        self.public_paths = public_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        is_open = scope["type"] == "lifespan" or scope["path"] in self.public_paths
        if is_open or self._is_authorized(scope):
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
        else:
            response = error_response(authentication_error())
            response.headers["WWW-Authenticate"] = "Bearer"
            await response(scope, receive, send)

    def _is_authorized(self, scope: Scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() == b"bearer":
                    return hmac.compare_digest(token.strip(), self._key)
        return False


class BodyLimitMiddleware:
    """The bounds of a request body: its size (413) and the time it takes to arrive (408).

    A body over `max_bytes` (by its Content-Length before reading, else by the bytes received: a
    chunked body has no length) gets a 413 with `Connection: close`, once the rest of it has been
    read and dropped (up to `max_drained_bytes`, within the body's time): a connection closed
    while the client's bytes are still unread is reset by the kernel, and the client would see
    the reset instead of the 413. A client that announced `Expect: 100-continue` has sent no body
    yet and gets the 413 at once. A body not received within `timeout` seconds of the request's
    start gets a 408 with `Connection: close` (the app reads the body before it answers, so a
    response can still start). Once the body is complete, `receive` passes through untouched.
    """

    def __init__(
        self, app: ASGIApp, max_bytes: int, timeout: float, max_drained_bytes: int
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout = timeout
        self.max_drained_bytes = max_drained_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        deadline = asyncio.get_running_loop().time() + self.timeout
        error = self._check_length(scope)
        if error is not None:
            if error.status == 413 and not _expects_continue(scope):
                await self._drain(receive, deadline)
            await error_response(error)(scope, receive, send)
            return
        num_received = 0
        is_complete = False

        async def limited_receive() -> Message:
            nonlocal num_received, is_complete
            if is_complete:
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise request_timeout(self.timeout) from None
            if message["type"] != "http.request":
                return message
            num_received += len(message.get("body", b""))
            is_complete = not message.get("more_body", False)
            if num_received > self.max_bytes:
                if not is_complete:
                    await self._drain(receive, deadline)
                raise request_too_large(self.max_bytes)
            return message

        await self.app(scope, limited_receive, send)

    async def _drain(self, receive: Receive, deadline: float) -> None:
        """Read and drop the rest of a body: up to max_drained_bytes, until the deadline."""
        num_dropped = 0
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout_at(deadline):
                while num_dropped <= self.max_drained_bytes:
                    message = await receive()
                    if message["type"] != "http.request" or not message.get("more_body"):
                        return
                    num_dropped += len(message.get("body", b""))

    def _check_length(self, scope: Scope) -> OpenAIError | None:
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    return invalid_request("Invalid Content-Length header.")
                if length > self.max_bytes:
                    return request_too_large(self.max_bytes)
        return None


def _expects_continue(scope: Scope) -> bool:
    return any(
        name == b"expect" and value.lower() == b"100-continue" for name, value in scope["headers"]
    )
