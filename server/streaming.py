"""Engine output streams of one HTTP request, and their server-sent events.

`EngineStreams.open` submits one engine request per prompt and waits for the first output of
each, so that everything the engine rejects (prompt too long, queue full...) surfaces as an
exception BEFORE a response starts; afterwards `outputs()` merges the streams in arrival order.
Closing it (or cancelling the task that reads it) closes every `AsyncEngine.generate` iterator,
which aborts the requests still running and frees their blocks.

Events follow OpenAI: `data: {json}\\n\\n` per chunk, `data: [DONE]\\n\\n` last; an error after the
stream started is sent as `data: {"error": {...}}` before `[DONE]`. `SSEResponse` closes its
event iterator however the response ends (finished, client gone, task cancelled).
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import Any

from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from engine.outputs import CompletionOutput, OutputAccumulator, RequestOutput
from engine.sampling_params import SamplingParams
from server.async_engine import AsyncEngine, EngineDeadError
from server.errors import SERVER_ERROR, OpenAIError, engine_unavailable, internal_error
from server.response_builders import ChatStream, CompletionStream
from server.token_bytes import TokenDecoder

logger = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class RequestAborted(RuntimeError):
    """The engine aborted a request the client still waits for (shutdown or an admin abort)."""


def aborted_error() -> OpenAIError:
    return OpenAIError(503, "The request was aborted by the server.", SERVER_ERROR, None, "aborted")


def check_not_aborted(output: RequestOutput) -> None:
    if any(c.finish_reason == "abort" for c in output.outputs):
        raise RequestAborted(output.request_id)


class EngineStreams:
    """The engine requests of one HTTP request (one per prompt), opened together, read merged."""

    def __init__(self, iterators: list[AsyncIterator[RequestOutput]], firsts: list[RequestOutput]):
        self._iterators = iterators
        self._firsts = firsts
        self._pending: dict[asyncio.Future[RequestOutput], int] = {}
        self._closing: asyncio.Future[None] | None = None

    @classmethod
    async def open(
        cls,
        engine: AsyncEngine,
        request_ids: Sequence[str],
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams,
        prediction: str | Sequence[int] | None = None,
    ) -> EngineStreams:
        """Submit every prompt and await each one's first output. Raises what `generate` raises
        (ValueError, QueueFullError, EngineDeadError) after aborting the others."""
        iterators = [
            engine.generate(rid, prompt, params, prediction)
            for rid, prompt in zip(request_ids, prompts, strict=True)
        ]
        firsts = [asyncio.ensure_future(it.__anext__()) for it in iterators]
        try:
            outputs = await asyncio.gather(*firsts)
        except BaseException:
            for task in firsts:
                task.cancel()
            await asyncio.gather(*firsts, return_exceptions=True)
            await _close_all(iterators)
            raise
        return cls(iterators, list(outputs))

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) in arrival order; each prompt's finished output is its last."""
        for index, output in enumerate(self._firsts):
            yield index, output
            if not output.finished:
                self._pending[asyncio.ensure_future(self._iterators[index].__anext__())] = index
        while self._pending:
            done, _ = await asyncio.wait(self._pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=self._pending.__getitem__):
                index = self._pending.pop(task)
                output = task.result()  # never StopAsyncIteration: we stop at the finished one
                yield index, output
                if not output.finished:
                    future = asyncio.ensure_future(self._iterators[index].__anext__())
                    self._pending[future] = index

    async def final(self) -> list[RequestOutput]:
        """Read to the end; each prompt's whole output (its outputs added up), in prompt order."""
        accumulator = OutputAccumulator()
        whole: dict[int, RequestOutput] = {}
        async for index, output in self.outputs():
            finished = accumulator.add(output)
            if finished is not None:
                whole[index] = finished
        return [whole[index] for index in range(len(self._firsts))]

    async def aclose(self) -> None:
        """Stop reading: requests still running are aborted. Safe to call more than once.

        The closing runs in a shielded task: a caller cancelled again while it waits (anyio
        cancels at every await inside a cancelled scope) must not leave a request running."""
        if self._closing is None:
            pending = list(self._pending)
            self._pending.clear()
            for task in pending:
                task.cancel()
            self._closing = asyncio.ensure_future(self._close(pending))
        await asyncio.shield(self._closing)

    async def _close(self, pending: list[asyncio.Future[RequestOutput]]) -> None:
        await asyncio.gather(*pending, return_exceptions=True)
        await _close_all(self._iterators)


async def _close_all(iterators: list[AsyncIterator[RequestOutput]]) -> None:
    for it in iterators:
        aclose = getattr(it, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(Exception):
                await aclose()


class TokenSplitter:
    """Splits an output whose step added several tokens to a choice into one output per token.

    The texts in between come from the tokens' own bytes (a character split across tokens waits
    for its last byte) and are clipped to a prefix of the step's text, so stop strings and
    skipped special tokens never show; a choice's last piece brings the rest of its text, its
    finish reason and its counters. The pieces add up to the output, which ends them."""

    def __init__(self, tokens: TokenDecoder) -> None:
        self._tokens = tokens

    def split(self, output: RequestOutput) -> list[RequestOutput]:
        steps = max((len(c.token_ids) for c in output.outputs), default=0)
        if steps <= 1:
            return [output]
        pieces = [self._pieces(c, steps) for c in output.outputs]
        split = [
            replace(output, outputs=[p[j] for p in pieces], finished=False)
            for j in range(steps - 1)
        ]
        return [*split, replace(output, outputs=[p[-1] for p in pieces])]

    def _pieces(self, c: CompletionOutput, steps: int) -> list[CompletionOutput]:
        """`c` in `steps` pieces: one per token, then empty ones."""
        num_tokens = len(c.token_ids)
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        decoded, num_shown = "", 0
        pieces = []
        for j, token_id in enumerate(c.token_ids[:-1]):
            decoded += decoder.decode(self._tokens.token_bytes(token_id))
            shown = len(_common_prefix(decoded, c.text))
            pieces.append(
                replace(
                    c,
                    text=c.text[num_shown:shown],
                    token_ids=[token_id],
                    logprobs=None if c.logprobs is None else c.logprobs[j : j + 1],
                    finish_reason=None,
                    stop_reason=None,
                    num_output_tokens=c.num_output_tokens - num_tokens + j + 1,
                    spec_stats=None,
                )
            )
            num_shown = shown
        logprobs = None if c.logprobs is None else c.logprobs[-1:]
        pieces.append(
            replace(c, text=c.text[num_shown:], token_ids=c.token_ids[-1:], logprobs=logprobs)
        )
        empty = replace(c, text="", token_ids=[], logprobs=None if c.logprobs is None else [])
        return pieces + [empty] * (steps - len(pieces))


def _common_prefix(a: str, b: str) -> str:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return a[:n]


def sse(chunk: BaseModel, include_usage: bool) -> bytes:
    """One event. Without include_usage the `usage` key is left out, as OpenAI does."""
    exclude = None if include_usage else {"usage"}
    return b"data: " + chunk.model_dump_json(exclude=exclude).encode() + b"\n\n"


def error_event(exc: BaseException, request_id: str) -> bytes:
    """The event that ends a stream that failed after it started."""
    if isinstance(exc, EngineDeadError):
        body: dict[str, Any] = engine_unavailable().body()
    elif isinstance(exc, RequestAborted):
        body = aborted_error().body()
    elif isinstance(exc, OpenAIError):
        body = exc.body()
    else:
        logger.error("stream %s failed", request_id, exc_info=exc)
        body = internal_error(request_id).body()
    return b"data: " + json.dumps(body).encode() + b"\n\n"


async def stream_events(
    streams: EngineStreams, builder: ChatStream | CompletionStream, splitter: TokenSplitter | None
) -> AsyncIterator[bytes]:
    """The events of a streamed chat completion (one prompt) or completions call (several
    prompts interleaving), then the usage chunk when asked, then [DONE]."""
    try:
        async for index, output in streams.outputs():
            check_not_aborted(output)
            for piece in splitter.split(output) if splitter else [output]:
                for chunk in builder.chunks(piece, index):
                    yield sse(chunk, builder.include_usage)
        usage = builder.usage_chunk()
        if usage is not None:
            yield sse(usage, True)
    except Exception as exc:
        yield error_event(exc, builder.meta.id)
    finally:
        await streams.aclose()
    yield DONE


class SSEResponse(StreamingResponse):
    """A `text/event-stream` response whose event iterator is closed however it ends.

    Starlette cancels the sending task when the client disconnects; an iterator suspended at a
    `yield` would then only be finalized by the garbage collector. Closing it here runs its
    `finally` at once, which aborts the engine requests."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes]) -> None:
        super().__init__(events, headers=SSE_HEADERS)
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self._events, "aclose", None)
            if aclose is not None:
                await aclose()
