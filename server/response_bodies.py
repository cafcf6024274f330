"""OpenAI response bodies (pydantic v2): chat completions, completions, stream chunks, models.

Field names and `object` literals follow the official OpenAPI spec; the unit tests validate the
serialized models against its JSON schemas. Logprobs are always finite: JSON has no -inf, so a
non-finite logprob becomes -9999.0, the value OpenAI documents for "very unlikely".

Our one extension, `speculative_decoding_stats` on a choice, is serialized only when set: a client
that did not opt in gets exactly the OpenAI shape (the key absent, not null).
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, SerializerFunctionWrapHandler, model_serializer

MIN_LOGPROB = -9999.0
SYSTEM_FINGERPRINT = "fp_specserve"

# The engine's "abort" has no OpenAI counterpart: an aborted request gets an error, not a choice.
# "tool_calls": the model stopped after calling tools (server/tool_calls.py decides).
FinishReason = Literal["stop", "length", "tool_calls"]


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


# --- specserve extension: per-choice speculation stats ---


class MethodStats(BaseModel):
    """One draft source's share of a choice's speculation."""

    num_draft_tokens: int
    num_accepted_draft_tokens: int


class SpeculativeDecodingStats(BaseModel):
    """How speculation went for one choice (opt-in: `speculation.return_stats` or the server's
    `speculation_stats` setting). A "spec step" is a verify step with at least one draft token.

    mean_acceptance_length: tokens emitted per spec step (accepted drafts + the recovered or bonus
    token), 1 + num_accepted_draft_tokens / num_spec_steps; 0.0 when there was no spec step, so
    "never speculated" (0.0) reads differently from "speculated, accepted nothing" (1.0).
    draft_acceptance_rate: num_accepted_draft_tokens / num_draft_tokens (0.0 without drafts).
    acceptance_histogram[a]: spec steps that accepted exactly a drafts; it sums to num_spec_steps
    and is as long as the largest a seen, plus one ([] without spec steps).
    by_method: per draft source that drafted for the choice (ngram, draft_model, eagle3,
    prediction, grammar), its draft tokens and accepted draft tokens.
    """

    mean_acceptance_length: float
    draft_acceptance_rate: float
    num_spec_steps: int
    num_draft_tokens: int
    num_accepted_draft_tokens: int
    acceptance_histogram: list[int]
    by_method: dict[str, MethodStats] = {}


class _Choice(BaseModel):
    """A choice whose `speculative_decoding_stats` (declared last by each subclass, so the key
    comes last) is left out of the JSON while unset."""

    @model_serializer(mode="wrap")
    def _drop_absent_stats(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        if data.get("speculative_decoding_stats") is None:
            data.pop("speculative_decoding_stats", None)
        return data


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


class _DropNone(BaseModel):
    """A body whose unset (None) fields are left out of the JSON: the spec types them without
    null."""

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class FunctionCall(BaseModel):
    """The function a tool call calls; arguments are JSON text, as the model wrote them."""

    name: str
    arguments: str


class ToolCall(BaseModel):
    """One tool call of a reply."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionCallChunk(_DropNone):
    """What a stream chunk adds to a call's function: its name once, then arguments pieces."""

    name: str | None = None
    arguments: str | None = None


class ToolCallChunk(_DropNone):
    """A fragment of the call at `index`: the first carries id, type and name."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallChunk | None = None


class ChatCompletionMessage(BaseModel):
    """The assistant's reply: content, and tool_calls (left out when there are none)."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_no_calls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        if data.get("tool_calls") is None:
            data.pop("tool_calls", None)
        return data


class ChatCompletionChoice(_Choice):
    """One of the n replies."""

    index: int
    message: ChatCompletionMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: FinishReason
    speculative_decoding_stats: SpeculativeDecodingStats | None = None  # extension


class ChatCompletionResponse(BaseModel):
    """The body of a non-streamed chat completion."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str = SYSTEM_FINGERPRINT
    choices: list[ChatCompletionChoice]
    usage: Usage


class ChatCompletionDelta(_DropNone):
    """What one chunk adds to a choice; unset fields are left out (the final delta is `{}`)."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallChunk] | None = None


class ChatCompletionStreamChoice(_Choice):
    """One choice inside a chunk; speculation stats ride on the one with the finish_reason."""

    index: int
    delta: ChatCompletionDelta
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None
    speculative_decoding_stats: SpeculativeDecodingStats | None = None  # extension


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


class CompletionChoice(_Choice):
    """One completion of one prompt (index = prompt_index * n + completion index)."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason
    speculative_decoding_stats: SpeculativeDecodingStats | None = None  # extension


class CompletionResponse(BaseModel):
    """The body of a non-streamed completion."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str = SYSTEM_FINGERPRINT
    choices: list[CompletionChoice]
    usage: Usage


class CompletionStreamChoice(_Choice):
    """A choice inside a completion chunk: finish_reason is null until the last one, which also
    carries the speculation stats when asked."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None
    speculative_decoding_stats: SpeculativeDecodingStats | None = None  # extension


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
    # specserve's own: the weights' format, "none" (dense) or "gguf (Q4_K + Q6_K)".
    quantization: str | None = None


class ModelList(BaseModel):
    """GET /v1/models."""

    object: Literal["list"] = "list"
    data: list[ModelCard]
