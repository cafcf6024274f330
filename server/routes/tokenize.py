"""POST /tokenize and POST /detokenize, with vLLM's request and response shapes.

/tokenize takes a text `prompt` or chat `messages` and answers `{"count", "max_model_len",
"tokens"}`; /detokenize takes `tokens` and answers `{"prompt"}`. The ids are the generation
endpoints' own: a prompt is encoded as /v1/completions encodes it (special tokens added unless
`add_special_tokens: false`); messages are rendered as /v1/chat/completions renders them (a
generation prompt unless `add_generation_prompt: false`, no special tokens unless
`add_special_tokens: true`), so by default `count` is a chat request's `usage.prompt_tokens`.
Detokenized text keeps special tokens: a chat's ids give back its rendered prompt.

The work runs on `PromptTokenizer`'s thread with that thread's tokenizer copy, never on the event
loop and never with the engine's tokenizer. Like the `speculation` extension, these bodies reject
unknown keys with a 400: they are ours, and a misspelt option would otherwise be ignored. `model`
is optional; another model's name is a 404. A model served without a tokenizer answers 400.
"""

from __future__ import annotations

from typing import Annotated, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from server.engine_inputs import messages_of
from server.errors import from_validation_error, from_value_error, invalid_request, model_not_found
from server.prompt_tokenizer import PromptTokenizer
from server.protocol import ChatMessage
from server.request_checks import fail
from server.routes.json_bodies import json_body, json_response
from server.state import ServerState, server_state

tokenize_router = APIRouter()
_OURS = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class TokenizeRequest(BaseModel):
    """POST /tokenize: exactly one of `prompt` (text) and `messages` (a chat)."""

    model_config = _OURS
    model: str | None = None
    prompt: Annotated[str, Field(min_length=1)] | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_generation_prompt: bool | None = None  # messages only; absent: true
    add_special_tokens: bool | None = None  # absent: true for a prompt, false for messages

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if self.prompt is not None and self.messages is not None:
            raise fail("give either prompt or messages, not both", param="messages")
        if self.prompt is None and self.messages is None:
            raise fail("prompt or messages is required", param="prompt")
        if self.messages is None and self.add_generation_prompt is not None:
            message = "add_generation_prompt applies to messages only"
            raise fail(message, param="add_generation_prompt")
        return self


class DetokenizeRequest(BaseModel):
    """POST /detokenize: token ids of the served model's tokenizer."""

    model_config = _OURS
    model: str | None = None
    tokens: Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class TokenizeResponse(BaseModel):
    """The prompt's token ids, their count and the context length they must fit in."""

    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    """The text of the token ids."""

    prompt: str


RequestT = TypeVar("RequestT", TokenizeRequest, DetokenizeRequest)


@tokenize_router.post("/tokenize")
async def tokenize(request: Request) -> Response:
    state = server_state(request.app)
    req = await _parse(request, state, TokenizeRequest)
    tokenizer, max_model_len = _tokenizer(state)
    try:
        if req.messages is not None:
            ids = await tokenizer.tokenize_chat(
                messages_of(req.messages),
                add_generation_prompt=req.add_generation_prompt is not False,
                add_special_tokens=req.add_special_tokens is True,
            )
        else:
            assert req.prompt is not None  # the validator's promise
            add_special_tokens = req.add_special_tokens is not False
            ids = await tokenizer.tokenize_text(req.prompt, add_special_tokens=add_special_tokens)
    except ValueError as e:
        raise from_value_error(e, TokenizeRequest.model_fields) from None
    return json_response(TokenizeResponse(count=len(ids), max_model_len=max_model_len, tokens=ids))


@tokenize_router.post("/detokenize")
async def detokenize(request: Request) -> Response:
    state = server_state(request.app)
    req = await _parse(request, state, DetokenizeRequest)
    tokenizer, _ = _tokenizer(state)
    try:
        text = await tokenizer.detokenize(req.tokens)
    except ValueError as e:
        raise from_value_error(e, DetokenizeRequest.model_fields) from None
    return json_response(DetokenizeResponse(prompt=text))


async def _parse(request: Request, state: ServerState, model: type[RequestT]) -> RequestT:
    """The validated body (400 otherwise), naming the served model or none (404 otherwise)."""
    try:
        req = model.model_validate_json(await json_body(request))
    except ValidationError as e:
        raise from_validation_error(e) from None
    if req.model is not None and req.model != state.settings.model_name:
        raise model_not_found(req.model)
    return req


def _tokenizer(state: ServerState) -> tuple[PromptTokenizer, int]:
    """The served model's prompt tokenizer and context length: 503 while no engine serves, 400
    for a model without a tokenizer."""
    serving = state.ready()
    if serving.prompt_tokenizer is None:
        raise invalid_request("this model has no tokenizer, so it cannot tokenize or detokenize.")
    return serving.prompt_tokenizer, serving.async_engine.engine.max_model_len
