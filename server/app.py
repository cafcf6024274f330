"""The FastAPI application: `create_app(settings)` builds one, with its state in one typed
`ServerState` on `app.state` (server/state.py).

Lifespan: at start-up the engine loads in a worker thread (GET /health answers 503 "loading"
meanwhile) and its `AsyncEngine` loop starts. At shutdown admission stops, in-flight requests get
up to `shutdown_timeout` seconds, and what is left is aborted, so every open stream ends with an
error event and [DONE]: the CLI starts that drain when the signal arrives (`begin_shutdown`),
while uvicorn still waits for the responses (its own deadline is later, `SHUTDOWN_GRACE_S`), and
the lifespan's end finishes it.
Meanwhile a background task logs the engine's stats every `log_stats_interval` seconds.
Start-up logs one line per phase with its time (engine.runtime.startup), the last "ready in X s",
counted from `started` (the CLI's start).

Middleware, outermost first: CORS (when origins are configured), the API key (a pure ASGI check
of `scope["path"]`, so nothing rebuilt from the Host header decides what is public), and the
body's bounds (its size, by Content-Length up front, then by the bytes actually received; the
time it takes to arrive). Every error leaves as an OpenAI envelope; a 500 carries no exception
text. The connection-level timeouts (headers, clients that stop reading) are uvicorn's protocol
in `server/connections.py`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from engine.engine import LLMEngine
from engine.models.generation_defaults import GenerationDefaults, load_generation_defaults
from engine.runtime.startup import log_ready, startup_phase
from server.async_engine import AsyncEngine, EngineDeadError
from server.errors import (
    INVALID_REQUEST,
    OpenAIError,
    internal_error,
    invalid_request,
    not_found,
)
from server.grammar_worker import GrammarWorker
from server.metrics import EngineSnapshot, format_stats_line, read_snapshot
from server.middleware import ApiKeyMiddleware, BodyLimitMiddleware, error_response
from server.prompt_tokenizer import PromptTokenizer, copies
from server.routes.admin import admin_router
from server.routes.generation import ClientDisconnected, generation_router
from server.routes.service import service_router, version
from server.routes.tokenize import tokenize_router
from server.settings import Settings
from server.state import ServerState, Serving, attach_state, server_state
from server.token_bytes import TokenDecoder
from server.tool_calls import model_tool_parser

logger = logging.getLogger(__name__)


def create_app(
    settings: Settings, async_engine: AsyncEngine | None = None, started: float | None = None
) -> FastAPI:
    """The app serving `settings`. Given an (unstarted) `async_engine`, it serves that one
    instead of loading `settings.model`; either way the lifespan starts and stops it. `started`:
    time.monotonic() when start-up began, which "ready in" counts from (default: now)."""
    app = FastAPI(
        title="specserve",
        version=version(),
        lifespan=_lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    attach_state(app, ServerState.new(settings, async_engine, started))
    app.include_router(service_router)
    app.include_router(generation_router)
    app.include_router(tokenize_router)
    app.include_router(admin_router)
    _add_error_handlers(app)
    app.add_middleware(
        BodyLimitMiddleware,
        max_bytes=settings.max_body_bytes,
        timeout=settings.body_timeout,
        max_drained_bytes=settings.max_drained_body_bytes,
    )
    if settings.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key)
    if settings.cors_allow_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.cors_allow_origins,
            allow_methods=["*"],
            allow_headers=["*"],
        )
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    state = server_state(app)
    loader: asyncio.Future[None] | None = None
    if state.given_engine is not None:
        _serve(state, state.given_engine)
        log_ready(state.started, f"serving {state.settings.model_name!r}")
    else:
        loader = asyncio.ensure_future(_load_engine(state))
    interval = state.settings.log_stats_interval
    stats_log = asyncio.ensure_future(_log_stats(state, interval)) if interval > 0 else None
    try:
        yield
    finally:
        if stats_log is not None:
            stats_log.cancel()
            await asyncio.gather(stats_log, return_exceptions=True)
        if loader is not None and not loader.done():
            loader.cancel()  # the loading thread runs on, but its engine is never served
            await asyncio.gather(loader, return_exceptions=True)
        begin_shutdown(app)
        if state.lifecycle.draining is not None:
            await state.lifecycle.draining
        if state.serving is not None:
            state.serving.close()


# Seconds the HTTP server waits for open responses past shutdown_timeout before it cancels them:
# the engine aborts what is left at shutdown_timeout, and the aborted streams' last events need
# a moment to be sent.
SHUTDOWN_GRACE_S = 5.0


def begin_shutdown(app: FastAPI) -> None:
    """Start the engine's drain (on the event loop; once): admission stops, in-flight requests
    get shutdown_timeout seconds, the rest are aborted and their streams end cleanly."""
    state = server_state(app)
    engine = state.async_engine
    if engine is None or state.lifecycle.draining is not None:
        return
    timeout = state.settings.shutdown_timeout
    logger.info("shutting down: in-flight requests get %.0f s", timeout)
    state.lifecycle.draining = asyncio.ensure_future(engine.shutdown(timeout))


async def _load_engine(state: ServerState) -> None:
    settings = state.settings
    logger.info("loading %s", settings.model)
    try:
        engine = await _in_own_thread(LLMEngine, settings.engine_config())
        with startup_phase("server"):
            _serve(state, AsyncEngine(engine, settings.max_queue))
        log_ready(state.started, f"serving {settings.model} as {settings.model_name!r}")
    except Exception as exc:
        logger.exception("the engine failed to load")
        state.lifecycle.load_error = exc
        stop = state.lifecycle.stop_server
        if stop is not None:
            stop()


_T = TypeVar("_T")


async def _in_own_thread(fn: Callable[..., _T], *args: object) -> _T:
    """fn(*args) on a one-shot thread that ends with it, not on the event loop's executor.

    Loading runs model forwards (warm-up, calibration), and the OpenMP runtime keeps a team of
    worker threads for every thread that ran parallel work until that thread exits. A persistent
    executor thread would leave its team behind, and with more OpenMP threads alive than CPUs,
    GNU OpenMP stops spin-waiting between parallel regions: the engine thread's workers then
    sleep and wake at every operator (docs/policy.md's policy bench shows what that cost)."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specserve-loader")
    try:
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)
    finally:
        pool.shutdown(wait=False)  # the thread exits once fn returns


async def _log_stats(state: ServerState, interval: float) -> None:
    """Every `interval` seconds, one log line of the engine's numbers over that interval (none
    while the engine is idle or not serving). The snapshot is read between steps, like /metrics."""
    previous: EngineSnapshot | None = None
    last = time.monotonic()
    while True:
        await asyncio.sleep(interval)
        engine = state.async_engine
        if engine is None or not engine.is_alive:
            continue
        try:
            current = await engine.call(read_snapshot)
        except EngineDeadError:
            continue
        except Exception:
            logger.exception("reading the engine stats failed: no more stats log lines")
            return
        now = time.monotonic()
        num_old_tokens = previous.num_generation_tokens if previous else 0
        is_idle = current.num_generation_tokens == num_old_tokens and not (
            current.num_running or current.num_waiting
        )
        if not is_idle:
            logger.info("%s", format_stats_line(previous, current, now - last))
        previous, last = current, now


def _serve(state: ServerState, async_engine: AsyncEngine) -> None:
    """Build what the routes serve with, start the engine loop, and only then publish it."""
    engine = async_engine.engine
    defaults = GenerationDefaults()
    if state.settings.generation_config == "auto":  # first: a bad file starts nothing
        defaults = load_generation_defaults(engine.model_config.path)
    # Before the engine thread starts: the copies are made while nothing else uses the tokenizer,
    # and from then on each thread has its own (the loop's token texts, the prompt tokenizer's
    # thread, the engine's detokenizer).
    token_decoder, prompt_tokenizer, tool_parser = None, None, None
    if engine.tokenizer is not None:
        for_tokens, for_prompts = copies(engine.tokenizer, 2)
        token_decoder = TokenDecoder(for_tokens)
        prompt_tokenizer = PromptTokenizer(for_prompts)
        model_type = getattr(engine.model_config.hf_config, "model_type", None)
        template = getattr(engine.tokenizer, "chat_template", None)
        tool_parser = model_tool_parser(state.settings.tool_parser, template, model_type)
    grammar_worker = GrammarWorker(engine.grammars) if engine.grammars is not None else None
    serving = Serving(
        async_engine=async_engine,
        token_decoder=token_decoder,
        prompt_tokenizer=prompt_tokenizer,
        tool_parser=tool_parser,
        grammar_worker=grammar_worker,
        generation_defaults=defaults,
    )
    try:
        async_engine.start()
    except BaseException:
        serving.close()
        raise
    state.lifecycle.begin_serving(serving)


# --------------------------------------------------------------------------- errors


def _add_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(OpenAIError, _openai_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(ClientDisconnected, _client_gone)
    app.add_exception_handler(ClientDisconnect, _client_gone)  # gone while sending the body
    app.add_exception_handler(Exception, _unexpected_error)


async def _openai_error(_: Request, exc: OpenAIError) -> Response:
    return error_response(exc)


async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    if exc.status_code == 404:
        return error_response(not_found(f"No route {request.method} {request.url.path}."))
    message = str(exc.detail) if exc.detail else "Request failed."
    return error_response(
        OpenAIError(exc.status_code, message, INVALID_REQUEST, headers=exc.headers)
    )


async def _validation_error(_: Request, exc: RequestValidationError) -> Response:
    return error_response(invalid_request("Invalid request."))


async def _client_gone(_: Request, __: Exception) -> Response:
    return Response(status_code=499)  # nobody reads it: the client has gone


async def _unexpected_error(request: Request, exc: Exception) -> Response:
    logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    return error_response(internal_error())
