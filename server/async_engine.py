"""`AsyncEngine`: the `LLMEngine` loop on its own thread, serving asyncio callers.

Threading contract:
- Every call into the `LLMEngine` (add_request, abort, step, and the functions given to `call`)
  runs on the engine thread. Asyncio code reaches it only through a thread-safe command queue
  that the loop drains at the top of every iteration, so an abort lands before the next step.
- Outputs go back through one asyncio.Queue per request, fed with `loop.call_soon_threadsafe`
  once a step per event loop (all that step's outputs for that loop's streams together).
  Each is what one step added to the request, and the engine never changes it afterwards, so the
  thread hands it over as it is; the queue keeps every one, so a consumer that falls behind still
  receives each delta, in order.
- Idle, the thread blocks on the command queue; with work, it steps back to back.
- If `engine.step()` raises, the error is logged, every in-flight and pending caller gets an
  `EngineDeadError`, and the engine stays dead (`is_alive` False).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import TypeVar

from engine.engine import LLMEngine
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams
from server.engine_channel import (
    Abort,
    Add,
    Call,
    Command,
    OutputStream,
    Stop,
    put_all,
    settle,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

_SHUTDOWN_POLL_S = 0.01
_JOIN_TIMEOUT_S = 30.0


class QueueFullError(RuntimeError):
    """Too many requests wait for admission; the caller should retry later (HTTP 429)."""


class EngineDeadError(RuntimeError):
    """The engine loop does not serve: it failed, was never started, or is shutting down (503)."""


class AsyncEngine:
    """Runs an `LLMEngine` on its own thread and streams its outputs to asyncio callers.

    `engine` must not be touched from other threads while the loop runs: use `call`.
    """

    def __init__(self, engine: LLMEngine, max_queue: int = 256) -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue must be at least 1, got {max_queue}.")
        self.engine = engine
        self.max_queue = max_queue
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        # Guards the flags and counts below, shared by the engine thread and asyncio callers.
        self._lock = threading.Lock()
        self._is_accepting = False
        self._is_closed = False  # the thread reads no more commands
        self._error: BaseException | None = None
        self._num_pending = 0  # adds sent but not yet taken by the engine thread
        self._num_waiting = 0
        self._num_running = 0
        self._num_unfinished = 0
        # Engine thread only.
        self._streams: dict[str, OutputStream] = {}
        self._num_taken = 0

    # ------------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the AsyncEngine was already started.")
        self._is_accepting = True
        self._thread = threading.Thread(target=self._run, name="specserve-engine", daemon=True)
        self._thread.start()

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Stop admitting, let in-flight requests finish for up to `timeout` seconds, abort the
        rest (their streams end with finish_reason "abort"), then stop the thread."""
        with self._lock:
            self._is_accepting = False
        if self._thread is None:
            return
        deadline = time.monotonic() + timeout
        while self.is_alive and self._has_work() and time.monotonic() < deadline:
            await asyncio.sleep(_SHUTDOWN_POLL_S)
        self._send(Stop())
        await asyncio.to_thread(self._thread.join, _JOIN_TIMEOUT_S)
        if self._thread.is_alive():
            logger.warning("the engine thread did not stop within %.0f s", _JOIN_TIMEOUT_S)

    @property
    def is_alive(self) -> bool:
        """The loop thread runs and has not failed."""
        thread = self._thread
        return thread is not None and thread.is_alive() and self._error is None

    @property
    def is_ready(self) -> bool:
        """Alive and admitting new requests."""
        return self.is_alive and self._is_accepting

    @property
    def num_running(self) -> int:
        return self._num_running

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    def _has_work(self) -> bool:
        with self._lock:
            return self._num_pending > 0 or self._num_unfinished > 0

    # ------------------------------------------------------------------------ asyncio side

    async def generate(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        prediction: str | Sequence[int] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs, each what one step added to it (see `engine.outputs`),
        the finished one last.

        Raises on the first `__anext__`, before any output: ValueError for input the engine
        rejects, QueueFullError when `max_queue` requests wait, EngineDeadError when the engine
        does not serve. Closing or cancelling the iteration aborts the request."""
        stream = OutputStream(asyncio.get_running_loop())
        self._submit(Add(request_id, prompt, params, prediction, time.monotonic(), stream))
        is_done = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    is_done = True
                    raise item
                is_done = item.finished
                yield item
                if is_done:
                    return
        finally:
            if not is_done:  # the consumer went away: free the request's blocks
                self._send(Abort(request_id, stream))

    async def abort(self, request_id: str) -> bool:
        """Abort a request; its stream ends with finish_reason "abort". False if unknown."""
        try:
            return await self.call(lambda _: self._abort(request_id, None))
        except EngineDeadError:
            return False

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn(engine)` on the engine thread between steps and return its result (for stats
        and checks; keep it short). Its exception is raised here and does not harm the loop."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        if not self._send(Call(fn, future, loop)):
            raise EngineDeadError(self._why_not_serving())
        return await future

    def _submit(self, command: Add) -> None:
        with self._lock:
            if not self._is_accepting:
                raise EngineDeadError(self._why_not_serving())
            if self._num_waiting + self._num_pending >= self.max_queue:
                raise QueueFullError(f"{self.max_queue} requests are already waiting.")
            self._num_pending += 1
            self._commands.put(command)

    def _send(self, command: Command) -> bool:
        with self._lock:
            if self._is_closed:
                return False
            self._commands.put(command)
            return True

    def _why_not_serving(self) -> str:
        if self._error is not None:
            return f"the engine loop failed: {self._error!r}"
        if self._thread is None:
            return "the engine is not started."
        return "the engine is shutting down."

    # ------------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        try:
            while self._run_once():
                pass
        except BaseException as exc:
            logger.exception("the engine loop died")
            self._fail_all(exc)
        finally:
            self._close()

    def _run_once(self) -> bool:
        for command in self._drain(block=not self.engine.has_unfinished_requests()):
            if isinstance(command, Stop):
                for request_id in list(self._streams):
                    self._abort(request_id, None)
                return False
            self._apply(command)
            # After every command, so that a `call` sees the counts of the commands before it.
            self._publish()
        if self.engine.has_unfinished_requests():
            self._deliver(self.engine.step())
            self._publish()
        return True

    def _drain(self, block: bool) -> Iterator[Command]:
        """Commands in arrival order; lazily, so that those after a stop stay queued."""
        if block:
            yield self._commands.get()
        while True:
            try:
                yield self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, command: Command) -> None:
        if isinstance(command, Add):
            self._add(command)
        elif isinstance(command, Abort):
            self._abort(command.request_id, command.stream)
        elif isinstance(command, Call):
            try:
                settle(command, command.fn(self.engine), None)
            except Exception as exc:
                settle(command, None, exc)

    def _add(self, command: Add) -> None:
        self._num_taken += 1
        try:
            self.engine.add_request(
                command.request_id,
                command.prompt,
                command.params,
                arrival_time=command.arrival_time,
                prediction=command.prediction,
            )
        except Exception as exc:  # ValueError for bad input; anything else is logged too
            if not isinstance(exc, ValueError):
                logger.exception("add_request(%r) failed", command.request_id)
            command.stream.put(exc)
            return
        command.stream.request = command
        self._streams[command.request_id] = command.stream

    def _abort(self, request_id: str, by: OutputStream | None) -> bool:
        """Abort a request. `by` set: its consumer left (abort only if that stream still owns the
        id: a rejected duplicate must not abort the original). `by` None: tell the consumer."""
        stream = self._streams.get(request_id)
        if by is not None and stream is not by:
            return False
        if not self.engine.abort(request_id):
            return False
        self._streams.pop(request_id, None)
        if by is None and stream is not None:
            stream.put(self._aborted_output(request_id, stream))
        return True

    def _aborted_output(self, request_id: str, stream: OutputStream) -> RequestOutput:
        if stream.last is not None:
            return stream.last.aborted()
        # Aborted before its first output (rare): rebuild the output from the request.
        request = stream.request
        assert request is not None
        params, prompt = request.params, request.prompt
        outputs = [
            CompletionOutput(
                i, finish_reason="abort", logprobs=[] if params.logprobs is not None else None
            )
            for i in range(params.n)
        ]
        prompt_text = prompt if isinstance(prompt, str) else None
        prompt_ids = self.engine.encode_prompt(prompt)
        return RequestOutput(request_id, prompt_text, prompt_ids, outputs, finished=True)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """The step's outputs to their streams: one wake-up per event loop for all of them."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[OutputStream, RequestOutput]]] = {}
        for output in outputs:
            try:
                stream = self._take(output)
            except Exception:  # one request's failure must not lose the others' outputs
                logger.exception("could not deliver the output of %r", output.request_id)
                self._fail_stream(output.request_id)
                continue
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream, output))
        for loop, items in by_loop.items():
            if put_all(loop, items):
                continue
            for stream, output in items:
                if not output.finished:
                    logger.warning("the consumer of %r is gone: aborting it", output.request_id)
                    self._abort(output.request_id, stream)

    def _take(self, output: RequestOutput) -> OutputStream | None:
        """The stream `output` goes to (None: nobody waits for it), its bookkeeping done."""
        stream = self._streams.get(output.request_id)
        if stream is None:
            return None
        if output.finished:
            del self._streams[output.request_id]
        else:
            stream.last = output
        return stream

    def _fail_stream(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            self.engine.abort(request_id)
            stream.put(RuntimeError(f"the output of request {request_id!r} could not be built."))

    def _publish(self) -> None:
        scheduler = self.engine.scheduler
        with self._lock:
            self._num_pending -= self._num_taken
            self._num_taken = 0
            self._num_waiting = len(scheduler.waiting)
            self._num_running = len(scheduler.running)
            self._num_unfinished = self.engine.num_unfinished_requests

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            self._error = exc
            self._is_accepting = False
        for stream in self._streams.values():
            error = EngineDeadError(self._why_not_serving())
            error.__cause__ = exc
            stream.put(error)
        self._streams.clear()

    def _close(self) -> None:
        with self._lock:
            self._is_closed = True
            self._is_accepting = False
            self._num_pending = 0
        # Commands sent before the flag was set: nobody else will read them.
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, Add):
                command.stream.put(EngineDeadError(self._why_not_serving()))
            elif isinstance(command, Call):
                settle(command, None, EngineDeadError(self._why_not_serving()))
