"""The OpenAI generation routes, POST /v1/chat/completions and /v1/completions: validate, hand
the request to the engine, answer with JSON or an SSE stream.

Every failure before a response starts is an `OpenAIError` (one handler in `server/app.py` turns
it into the envelope): a bad body 400, another model 404, a full queue 429, an engine that does
not serve 503. The engine's own checks (prompt too long, max_tokens beyond the context, token ids
outside the vocabulary) surface on the first output, which is awaited before a stream starts.
A client that goes away while its request waits or runs aborts the request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Sequence
from dataclasses import replace
from typing import TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.types import Receive

from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from server.async_engine import AsyncEngine, EngineDeadError, QueueFullError
from server.engine_inputs import prediction_of, prompt_of, to_sampling_params, wants_spec_stats
from server.errors import (
    engine_unavailable,
    from_value_error,
    invalid_request,
    model_not_found,
    server_overloaded,
)
from server.protocol import ChatCompletionRequest, CompletionRequest, parse_request, unknown_fields
from server.request_limits import check_requested_tokens
from server.response_builders import (
    ChatStream,
    CompletionStream,
    ResponseMeta,
    build_chat_response,
    build_completion_response,
)
from server.routes.json_bodies import json_body, json_response
from server.state import ServerState, Serving, server_state
from server.streaming import EngineStreams, SSEResponse, TokenSplitter, aborted_error, stream_events
from server.tool_calls import tool_use

logger = logging.getLogger(__name__)

generation_router = APIRouter()
T = TypeVar("T")
RequestT = TypeVar("RequestT", ChatCompletionRequest, CompletionRequest)
RETRY_AFTER_S = 1.0


class ClientDisconnected(Exception):
    """The client closed the connection before its response was ready."""


@generation_router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    state = server_state(request.app)
    req = await _parse(request, state, ChatCompletionRequest)
    serving = state.ready()
    engine = serving.async_engine
    params = _sampling_params(serving, req)
    tokenizer = serving.prompt_tokenizer
    if tokenizer is None:
        raise invalid_request("this model has no tokenizer: use /v1/completions.", "messages")
    tools = tool_use(req, serving.tool_parser)
    if tools.structured is not None:
        params = replace(params, structured=tools.structured)
    await _compile(serving, params, "tools" if tools.structured else "response_format")
    try:
        prompt_ids = await tokenizer.chat(prompt_of(req), tools.template_tools)
    except ValueError as e:
        raise from_value_error(e, ChatCompletionRequest.model_fields) from None
    given = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    _check_tokens(state, engine, params, [len(prompt_ids)], given)
    predicted_text = prediction_of(req)
    prediction = None
    if predicted_text:
        (prediction,) = await tokenizer.texts([predicted_text])
    meta = ResponseMeta.new("chatcmpl", state.settings.model_name)
    streams = await _open(request, engine, [meta.id], [prompt_ids], params, prediction)
    spec_stats = wants_spec_stats(req, state.settings.speculation_stats)
    tokens = serving.token_decoder
    if req.stream:
        builder = ChatStream(
            meta, tokens, _include_usage(req), spec_stats, tool_parser=tools.parser
        )
        return SSEResponse(stream_events(streams, builder, _splitter(state, serving)))
    (output,) = await _final(request, streams)
    return json_response(build_chat_response(meta, output, tokens, spec_stats, tools.parser))


@generation_router.post("/v1/completions")
async def completions(request: Request) -> Response:
    state = server_state(request.app)
    req = await _parse(request, state, CompletionRequest)
    serving = state.ready()
    engine = serving.async_engine
    params = _sampling_params(serving, req)
    await _compile(serving, params)
    prompts: Sequence[str | Sequence[int]] = prompt_of(req)
    # Completions always have a max_tokens: counting them needs no prompt length.
    _check_tokens(state, engine, params, [0] * len(prompts), "max_tokens")
    if serving.prompt_tokenizer is not None:  # else the engine says text needs a tokenizer
        prompts = await serving.prompt_tokenizer.texts(prompts)
    meta = ResponseMeta.new("cmpl", state.settings.model_name)
    ids = [meta.id] if len(prompts) == 1 else [f"{meta.id}-{i}" for i in range(len(prompts))]
    streams = await _open(request, engine, ids, prompts, params, None)
    spec_stats = wants_spec_stats(req, state.settings.speculation_stats)
    tokens = serving.token_decoder
    if req.stream:
        builder = CompletionStream(meta, tokens, params.n, _include_usage(req), spec_stats)
        return SSEResponse(stream_events(streams, builder, _splitter(state, serving)))
    outputs = await _final(request, streams)
    return json_response(build_completion_response(meta, outputs, tokens, spec_stats))


# --------------------------------------------------------------------------- helpers


async def _parse(request: Request, state: ServerState, model: type[RequestT]) -> RequestT:
    """The validated body: JSON object of the endpoint's schema, for the served model."""
    req = parse_request(model, await json_body(request), state.limits)
    if req.model != state.settings.model_name:
        raise model_not_found(req.model)
    extra = unknown_fields(req)
    if extra:
        logger.info("%s: ignoring unknown fields %s", request.url.path, ", ".join(extra))
    return req


def _sampling_params(
    serving: Serving, req: ChatCompletionRequest | CompletionRequest
) -> SamplingParams:
    defaults = serving.generation_defaults  # the model's (server/app.py)
    try:
        return to_sampling_params(req, default_max_tokens=None, defaults=defaults)
    except ValueError as e:
        raise from_value_error(e, type(req).model_fields) from None


async def _compile(
    serving: Serving, params: SamplingParams, param: str = "response_format"
) -> None:
    """A request's structured-output grammar, compiled off the loop and the engine thread;
    `param` is the field that asked for it (a 400 names it)."""
    if params.structured is None:
        return
    worker = serving.grammar_worker
    if worker is None:
        raise invalid_request("this model has no tokenizer: no structured outputs.", param)
    await worker.compile(params.structured, param)


def _check_tokens(
    state: ServerState,
    engine: AsyncEngine,
    params: SamplingParams,
    prompt_lens: Sequence[int],
    param: str,
) -> None:
    """400 when the request may generate more tokens than `max_tokens_per_request` allows."""
    check_requested_tokens(
        state.limits,
        engine.engine.max_model_len,
        n=params.n,
        max_tokens=params.max_tokens,
        prompt_lens=prompt_lens,
        param=param,
    )


def _include_usage(req: ChatCompletionRequest | CompletionRequest) -> bool:
    return bool(req.stream_options is not None and req.stream_options.include_usage)


def _splitter(state: ServerState, serving: Serving) -> TokenSplitter | None:
    """One chunk per token when the settings ask for it; a model served without a tokenizer has
    no token texts to split by, so its chunks stay one per step."""
    tokens = serving.token_decoder
    if not state.settings.stream_one_token_per_chunk or tokens is None:
        return None
    return TokenSplitter(tokens)


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
