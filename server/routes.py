"""The HTTP routes: validate, hand the request to the engine, answer with JSON or an SSE stream.

Every failure before a response starts is an `OpenAIError` (one handler in `server/app.py` turns
it into the envelope): a bad body 400, another model 404, a full queue 429, an engine that does
not serve 503. The engine's own checks (prompt too long, max_tokens beyond the context, token ids
outside the vocabulary) surface on the first output, which is awaited before a stream starts.
A client that goes away while its request waits or runs aborts the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import logging
from collections.abc import Awaitable, Sequence
from dataclasses import replace
from typing import TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.types import Receive

from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from server.async_engine import AsyncEngine, EngineDeadError, QueueFullError
from server.engine_inputs import prediction_of, prompt_of, to_sampling_params, wants_spec_stats
from server.errors import (
    from_value_error,
    invalid_request,
    model_not_found,
    server_overloaded,
)
from server.metrics import CONTENT_TYPE, read_snapshot, render
from server.protocol import ChatCompletionRequest, CompletionRequest, parse_request, unknown_fields
from server.request_limits import check_requested_tokens
from server.response_builders import (
    ChatStream,
    CompletionStream,
    ResponseMeta,
    build_chat_response,
    build_completion_response,
)
from server.response_format import GrammarWorker
from server.responses import ModelCard, ModelList
from server.streaming import (
    EngineStreams,
    SSEResponse,
    TokenSplitter,
    aborted_error,
    engine_unavailable,
    stream_events,
)
from server.tokenization import PromptTokenizer
from server.tool_calls import tool_use

logger = logging.getLogger(__name__)

router = APIRouter()
T = TypeVar("T")
RequestT = TypeVar("RequestT", ChatCompletionRequest, CompletionRequest)
RETRY_AFTER_S = 1.0


class ClientDisconnected(Exception):
    """The client closed the connection before its response was ready."""


def version() -> str:
    try:
        return importlib.metadata.version("specserve")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


# --------------------------------------------------------------------------- public routes


@router.get("/health")
async def health(request: Request) -> Response:
    """200 while the engine serves; 503 while it loads, after it failed, or while stopping."""
    state = request.app.state
    engine: AsyncEngine | None = state.async_engine
    if engine is not None and engine.is_ready:
        return JSONResponse({"status": "ok"})
    if state.load_error is not None:
        status = "failed"
    else:
        status = "loading" if engine is None else "unavailable"
    return JSONResponse({"status": status}, status_code=503)


@router.get("/version")
async def get_version() -> Response:
    return JSONResponse({"version": version()})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    state = request.app.state
    engine: AsyncEngine | None = state.async_engine
    if engine is not None and engine.is_alive:
        with contextlib.suppress(EngineDeadError):  # then export the last snapshot
            state.metrics_collector.update(await engine.call(read_snapshot))
    return Response(render(state.metrics_registry), media_type=CONTENT_TYPE)


# --------------------------------------------------------------------------- OpenAI routes


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    body = ModelList(data=[_model_card(request)]).model_dump_json(exclude_none=True)
    return Response(body, media_type="application/json")


@router.get("/v1/models/{model_id:path}")
async def get_model(request: Request, model_id: str) -> Response:
    if model_id != request.app.state.settings.model_name:
        raise model_not_found(model_id)
    body = _model_card(request).model_dump_json(exclude_none=True)
    return Response(body, media_type="application/json")


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    state = request.app.state
    req = await _parse(request, ChatCompletionRequest)
    engine = _serving_engine(request)
    params = _sampling_params(request, req)
    tokenizer: PromptTokenizer | None = state.prompt_tokenizer
    if tokenizer is None:
        raise invalid_request("this model has no tokenizer: use /v1/completions.", "messages")
    tools = tool_use(req, state.tool_parser)
    if tools.structured is not None:
        params = replace(params, structured=tools.structured)
    await _compile(request, params, "tools" if tools.structured else "response_format")
    try:
        prompt_ids = await tokenizer.chat(prompt_of(req), tools.template_tools)
    except ValueError as e:
        raise from_value_error(e, ChatCompletionRequest.model_fields) from None
    given = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    _check_tokens(request, engine, params, [len(prompt_ids)], given)
    predicted_text = prediction_of(req)
    prediction = None
    if predicted_text:
        (prediction,) = await tokenizer.texts([predicted_text])
    meta = ResponseMeta.new("chatcmpl", state.settings.model_name)
    streams = await _open(request, engine, [meta.id], [prompt_ids], params, prediction)
    spec_stats = wants_spec_stats(req, state.settings.speculation_stats)
    if req.stream:
        builder = ChatStream(
            meta, state.tokens, _include_usage(req), spec_stats, tool_parser=tools.parser
        )
        return SSEResponse(stream_events(streams, builder, _splitter(request)))
    (output,) = await _final(request, streams)
    return _json(build_chat_response(meta, output, state.tokens, spec_stats, tools.parser))


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    state = request.app.state
    req = await _parse(request, CompletionRequest)
    engine = _serving_engine(request)
    params = _sampling_params(request, req)
    await _compile(request, params)
    prompts = prompt_of(req)
    # Completions always have a max_tokens: counting them needs no prompt length.
    _check_tokens(request, engine, params, [0] * len(prompts), "max_tokens")
    if state.prompt_tokenizer is not None:  # else the engine says text needs a tokenizer
        prompts = await state.prompt_tokenizer.texts(prompts)
    meta = ResponseMeta.new("cmpl", state.settings.model_name)
    ids = [meta.id] if len(prompts) == 1 else [f"{meta.id}-{i}" for i in range(len(prompts))]
    streams = await _open(request, engine, ids, prompts, params, None)
    spec_stats = wants_spec_stats(req, state.settings.speculation_stats)
    if req.stream:
        builder = CompletionStream(meta, state.tokens, params.n, _include_usage(req), spec_stats)
        return SSEResponse(stream_events(streams, builder, _splitter(request)))
    outputs = await _final(request, streams)
    return _json(build_completion_response(meta, outputs, state.tokens, spec_stats))


# --------------------------------------------------------------------------- helpers


async def json_body(request: Request) -> bytes:
    """The raw body, once its Content-Type says JSON (a body without one is taken as JSON)."""
    content_type = request.headers.get("content-type")
    if content_type is not None and not _is_json(content_type):
        message = f"Content-Type must be application/json, got {content_type!r}."
        raise invalid_request(message, code="invalid_content_type")
    return await request.body()


async def _parse(request: Request, model: type[RequestT]) -> RequestT:
    """The validated body: JSON object of the endpoint's schema, for the served model."""
    req = parse_request(model, await json_body(request), request.app.state.limits)
    if req.model != request.app.state.settings.model_name:
        raise model_not_found(req.model)
    extra = unknown_fields(req)
    if extra:
        logger.info("%s: ignoring unknown fields %s", request.url.path, ", ".join(extra))
    return req


def _is_json(content_type: str) -> bool:
    media_type = content_type.split(";", 1)[0].strip().lower()
    return media_type == "application/json" or media_type.endswith("+json")


def _serving_engine(request: Request) -> AsyncEngine:
    engine: AsyncEngine | None = request.app.state.async_engine
    if engine is None or not engine.is_ready:
        raise engine_unavailable()
    return engine


def _sampling_params(
    request: Request, req: ChatCompletionRequest | CompletionRequest
) -> SamplingParams:
    defaults = request.app.state.generation_defaults  # the model's (server/app.py)
    try:
        return to_sampling_params(req, default_max_tokens=None, defaults=defaults)
    except ValueError as e:
        raise from_value_error(e, type(req).model_fields) from None


async def _compile(
    request: Request, params: SamplingParams, param: str = "response_format"
) -> None:
    """A request's structured-output grammar, compiled off the loop and the engine thread;
    `param` is the field that asked for it (a 400 names it)."""
    if params.structured is None:
        return
    worker: GrammarWorker | None = request.app.state.grammar_worker
    if worker is None:
        raise invalid_request("this model has no tokenizer: no structured outputs.", param)
    await worker.compile(params.structured, param)


def _check_tokens(
    request: Request,
    engine: AsyncEngine,
    params: SamplingParams,
    prompt_lens: Sequence[int],
    param: str,
) -> None:
    """400 when the request may generate more tokens than `max_tokens_per_request` allows."""
    check_requested_tokens(
        request.app.state.limits,
        engine.engine.max_model_len,
        n=params.n,
        max_tokens=params.max_tokens,
        prompt_lens=prompt_lens,
        param=param,
    )


def _include_usage(req: ChatCompletionRequest | CompletionRequest) -> bool:
    return bool(req.stream_options is not None and req.stream_options.include_usage)


def _splitter(request: Request) -> TokenSplitter | None:
    state = request.app.state
    return TokenSplitter(state.tokens) if state.settings.stream_one_token_per_chunk else None


async def _open(
    request: Request,
    engine: AsyncEngine,
    request_ids: Sequence[str],
    prompts: Sequence[str | Sequence[int]],
    params: SamplingParams,
    prediction: str | Sequence[int] | None,
) -> EngineStreams:
    """Submit the engine requests and wait for their first outputs (or the client leaving)."""
    try:
        return await _unless_disconnected(
            request.receive, EngineStreams.open(engine, request_ids, prompts, params, prediction)
        )
    except ValueError as e:
        known = ("prompt", "messages", "max_tokens", "max_completion_tokens", "logit_bias")
        aliases = {"prompt": "messages"} if request.url.path.endswith("/chat/completions") else {}
        raise from_value_error(e, known, aliases) from None
    except QueueFullError:
        error = server_overloaded(RETRY_AFTER_S)
        error.headers["x-should-retry"] = "true"
        raise error from None
    except EngineDeadError:
        raise engine_unavailable() from None


async def _final(request: Request, streams: EngineStreams) -> list[RequestOutput]:
    """Every prompt's finished output; aborts the requests if the client goes away first."""
    try:
        outputs = await _unless_disconnected(request.receive, streams.final())
    except EngineDeadError:
        raise engine_unavailable() from None
    finally:
        await streams.aclose()
    if any(c.finish_reason == "abort" for output in outputs for c in output.outputs):
        raise aborted_error()
    return outputs


async def _unless_disconnected(receive: Receive, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it if the client disconnects first (the body is already read,
    so the next ASGI message can only be the disconnect)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _model_card(request: Request) -> ModelCard:
    state = request.app.state
    engine = state.async_engine
    quantization = getattr(engine.engine, "quantization", None) if engine is not None else None
    return ModelCard(id=state.settings.model_name, created=state.created, quantization=quantization)


def _json(body: BaseModel, status: int = 200) -> Response:
    return Response(body.model_dump_json(), status_code=status, media_type="application/json")
