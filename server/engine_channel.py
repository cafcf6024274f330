"""What passes between `AsyncEngine`'s asyncio callers and its engine thread: commands one way
(through one thread-safe queue), each request's outputs the other (through its `OutputStream`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from engine.engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams


class OutputStream:
    """One request's channel from the engine thread to its asyncio consumer."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        # Engine thread only: the admitted request and the latest output sent.
        self.request: Add | None = None
        self.last: RequestOutput | None = None

    def put(self, item: RequestOutput | BaseException) -> bool:
        """Hand an item to the consumer; False if its event loop is closed."""
        return put_all(self.loop, [(self, item)])


def put_all(
    loop: asyncio.AbstractEventLoop,
    items: Sequence[tuple[OutputStream, RequestOutput | BaseException]],
) -> bool:
    """Hand a step's outputs for streams of one event loop over in one wake-up of that loop
    (each `call_soon_threadsafe` writes to the loop's self-pipe: one write a step, not one a
    stream); False if the loop is closed."""
    try:
        loop.call_soon_threadsafe(_put_items, items)
    except RuntimeError:
        return False
    return True


def _put_items(items: Sequence[tuple[OutputStream, RequestOutput | BaseException]]) -> None:
    for stream, item in items:
        stream.queue.put_nowait(item)


@dataclass(frozen=True)
class Add:
    request_id: str
    prompt: str | Sequence[int]
    params: SamplingParams
    prediction: str | Sequence[int] | None
    arrival_time: float
    stream: OutputStream


@dataclass(frozen=True)
class Abort:
    request_id: str
    stream: OutputStream  # abort only if this stream still owns the id (a disconnect)


@dataclass(frozen=True)
class Call:
    fn: Callable[[LLMEngine], Any]
    future: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop


class Stop:
    """Abort what is left and end the loop."""


Command = Add | Abort | Call | Stop


def settle(command: Call, result: Any, exc: BaseException | None) -> None:
    """Resolve a call's future on its own event loop (unless the caller gave up on it)."""

    def set_outcome() -> None:
        if command.future.done():
            return
        if exc is not None:
            command.future.set_exception(exc)
        else:
            command.future.set_result(result)

    with contextlib.suppress(RuntimeError):  # the caller's event loop is closed
        command.loop.call_soon_threadsafe(set_outcome)
