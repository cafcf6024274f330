"""OpenAI response bodies (pydantic v2): chat completions, completions, stream chunks, models.

Field names and `object` literals follow the official OpenAPI spec; the unit tests validate the
serialized models against its JSON schemas. Logprobs are always finite: JSON has no -inf, so a
non-finite logprob becomes -9999.0, the value OpenAI documents for "very unlikely".
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, SerializerFunctionWrapHandler, model_serializer

MIN_LOGPROB = -9999.0
SYSTEM_FINGERPRINT = "fp_specserve"

# The engine's "abort" has no OpenAI counterpart: an aborted request gets an error, not a choice.
FinishReason = Literal["stop", "length"]


def _finite_logprob(value: float) -> float:
    return value if math.isfinite(value) else MIN_LOGPROB


Logprob = Annotated[float, AfterValidator(_finite_logprob)]


class PromptTokensDetails(BaseModel):
    """Prompt tokens served from the prefix cache."""

    cached_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    """Predicted Outputs accounting: drafts from `prediction` the target accepted or rejected."""

    reasoning_tokens: int = 0
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class Usage(BaseModel):
    """Token counts of a whole request (all choices)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()
    completion_tokens_details: CompletionTokensDetails = CompletionTokensDetails()


# --- chat completions ---


class TopLogprob(BaseModel):
    """One alternative at a position: token text, logprob and the token's UTF-8 bytes."""

    token: str
    logprob: Logprob
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    """The chosen token at a position, with the most likely alternatives."""

    top_logprobs: list[TopLogprob]


class ChatChoiceLogprobs(BaseModel):
    """`choices[i].logprobs` of a chat completion or chunk."""

    content: list[ChatTokenLogprob] | None
    refusal: list[ChatTokenLogprob] | None = None


class ChatCompletionMessage(BaseModel):
    """The assistant's reply."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None


class ChatCompletionChoice(BaseModel):
    """One of the n replies."""

    index: int
    message: ChatCompletionMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: FinishReason


class ChatCompletionResponse(BaseModel):
    """The body of a non-streamed chat completion."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str = SYSTEM_FINGERPRINT
    choices: list[ChatCompletionChoice]
    usage: Usage


class ChatCompletionDelta(BaseModel):
    """What one chunk adds to a choice; unset fields are left out (the final delta is `{}`)."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatCompletionStreamChoice(BaseModel):
    """One choice inside a chunk."""

    index: int
    delta: ChatCompletionDelta
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed chat completion. With `include_usage` the last chunk
    has no choices and carries `usage`; every other chunk has `usage: null`."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str = SYSTEM_FINGERPRINT
    choices: list[ChatCompletionStreamChoice]
    usage: Usage | None = None


# --- completions (legacy) ---


class CompletionLogprobs(BaseModel):
    """Legacy logprobs: parallel lists, one entry per token; `text_offset` counts characters
    from the start of the choice's text."""

    tokens: list[str]
    token_logprobs: list[Logprob]
    top_logprobs: list[dict[str, Logprob]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    """One completion of one prompt (index = prompt_index * n + completion index)."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason


class CompletionResponse(BaseModel):
    """The body of a non-streamed completion."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str = SYSTEM_FINGERPRINT
    choices: list[CompletionChoice]
    usage: Usage


class CompletionStreamChoice(BaseModel):
    """A choice inside a completion chunk: finish_reason is null until the last one."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None


class CompletionChunk(BaseModel):
    """One server-sent event of a streamed completion (same `object` as the full response)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str = SYSTEM_FINGERPRINT
    choices: list[CompletionStreamChoice]
    usage: Usage | None = None


# --- models ---


class ModelCard(BaseModel):
    """One entry of GET /v1/models."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "specserve"


class ModelList(BaseModel):
    """GET /v1/models."""

    object: Literal["list"] = "list"
    data: list[ModelCard]
