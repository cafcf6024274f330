"""OpenAI request bodies (pydantic v2), in the order of the API documentation, then our extensions.

Types are strict: an integer field takes only a JSON integer (not 1.0, "1" or true), a boolean
only true/false, a number no NaN or infinity. Unknown fields are tolerated (`extra="allow"`) and
listed by `unknown_fields` so that the route can log them. OpenAI parameters this server does not
implement (the deprecated functions, audio, suffix, echo, best_of > n) are rejected with
a 400, never silently dropped. `parse_request` is the one validation path: any bad body
leaves it as an `OpenAIError` 400 naming the offending field as `param`.

Decisions: /v1/completions' `max_tokens` is 16 whether absent or null (OpenAI's default for that
endpoint); chat's absent or null max_tokens means "up to the end of the context". `seed` takes
the spec's int64 range and a negative seed is mapped into the engine's unsigned 64-bit range by
two's complement (`seed % 2**64`), so distinct seeds stay distinct. Counts are bounded by the
server's `RequestLimits` (`server/request_limits.py`), given to `parse_request`. `echo` is
rejected (not implemented). The `speculation` extension, unlike OpenAI's objects, rejects unknown
keys. Messages are `server/chat_messages.py`'s, tools and tool choices `server/tool_protocol.py`'s,
`response_format` `server/structured_protocol.py`'s. Response bodies live in
`server/response_bodies.py`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from server.chat_messages import ChatMessage, TextOrParts
from server.errors import from_validation_error, invalid_request
from server.request_checks import (
    check_logit_bias,
    check_prompt,
    check_stop,
    fail,
    reject_null,
    reject_unsupported,
)
from server.request_limits import RequestLimits, limits_of, num_sequences_error
from server.structured_protocol import ResponseFormat
from server.tool_protocol import FunctionTool, ToolChoice, check_tools

N_MAX = 16  # most choices per request (`n`); read at validation time, so a server may change it
COMPLETIONS_MAX_TOKENS = 16  # OpenAI's max_tokens for /v1/completions, absent or null
MAX_STOP_TOKEN_IDS = 64
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

# OpenAI parameters this server does not implement: any value but null is a 400.
_UNSUPPORTED = ("audio", "function_call", "functions", "suffix", "web_search_options")
_HINTS = {"functions": "deprecated: use tools", "function_call": "deprecated: use tool_choice"}
_STRICT = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)
Penalty = Annotated[float | None, Field(ge=-2.0, le=2.0)]
PositiveInt = Annotated[int | None, Field(ge=1)]
Seed = Annotated[int | None, Field(ge=INT64_MIN, le=INT64_MAX)]
Temperature = Annotated[float | None, Field(ge=0.0, le=2.0)]
TopP = Annotated[float | None, Field(ge=0.0, le=1.0)]
TopK = Annotated[int | None, Field(ge=-1)]  # -1 or 0: disabled
MinP = Annotated[float | None, Field(ge=0.0, le=1.0)]
RepetitionPenalty = Annotated[float | None, Field(gt=0.0, le=2.0)]
MinTokens = Annotated[int | None, Field(ge=0)]
StopTokenIds = Annotated[
    list[Annotated[int, Field(ge=0)]] | None, Field(max_length=MAX_STOP_TOKEN_IDS)
]


Stop = Annotated[str | list[str] | None, BeforeValidator(check_stop)]
Prompt = Annotated[str | list[str] | list[int] | list[list[int]], BeforeValidator(check_prompt)]


class StreamOptions(BaseModel):
    """`stream_options`: only valid with `stream: true`."""

    model_config = _STRICT
    include_usage: bool | None = None
    include_obfuscation: bool | None = None


class Prediction(BaseModel):
    """Predicted Outputs: the client's guess of the output, a draft source for speculation."""

    model_config = _STRICT
    type: Literal["content"]
    content: TextOrParts


class SpeculationOptions(BaseModel):
    """specserve extension: per-request control of speculative decoding.

    `enabled: false` opts the request out (it never drafts); `max_draft_tokens` caps the drafts
    per step (0 is the same as opting out); `return_stats` adds `speculative_decoding_stats` to
    each choice. Unlike OpenAI's objects, unknown keys are a 400: a misspelt control of our own
    would otherwise be silently ignored.
    """

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)
    enabled: bool = True
    max_draft_tokens: Annotated[int | None, Field(ge=0)] = None
    return_stats: bool = False


class _RequestBase(BaseModel):
    """Checks shared by both endpoints; they apply to the fields each subclass declares."""

    model_config = _STRICT

    @field_validator("logit_bias", check_fields=False)
    @classmethod
    def _logit_bias(
        cls, bias: dict[str, float] | None, info: ValidationInfo
    ) -> dict[str, float] | None:
        return check_logit_bias(bias, info)

    @field_validator("n", check_fields=False)
    @classmethod
    def _n_max(cls, n: int | None) -> int | None:
        if n is not None and n > N_MAX:
            raise fail(f"must be at most {N_MAX}")
        return n

    @field_validator("user", mode="before", check_fields=False)
    @classmethod
    def _user_not_null(cls, value: Any, info: ValidationInfo) -> Any:
        return reject_null(value, info)

    @field_validator(*_UNSUPPORTED, check_fields=False)
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        return reject_unsupported(value, info, _HINTS.get(info.field_name or "", ""))

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _RequestBase:
        if getattr(self, "stream_options", None) is not None and not getattr(self, "stream", None):
            raise fail("stream_options is only allowed with stream: true", param="stream_options")
        return self

    @model_validator(mode="after")
    def _num_sequences(self, info: ValidationInfo) -> _RequestBase:
        n = getattr(self, "n", None) or 1
        num_prompts = self.num_prompts()
        message = num_sequences_error(num_prompts, n, limits_of(info))
        if message is not None:
            raise fail(message, param="n" if n > 1 or num_prompts == 1 else "prompt")
        return self

    def num_prompts(self) -> int:
        """The engine requests it becomes before `n` copies: one per completions prompt."""
        return 1


class ChatCompletionRequest(_RequestBase):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    model: str
    audio: Any = None
    frequency_penalty: Penalty = None
    function_call: Any = None
    functions: Any = None
    logit_bias: dict[str, float] | None = None
    logprobs: bool | None = None
    max_completion_tokens: PositiveInt = None
    max_tokens: PositiveInt = None  # deprecated by OpenAI; max_completion_tokens wins
    modalities: list[Literal["text"]] | None = None
    n: PositiveInt = None
    parallel_tool_calls: bool | None = None  # absent or null: true
    prediction: Prediction | None = None
    presence_penalty: Penalty = None
    response_format: ResponseFormat | None = None
    seed: Seed = None
    stop: Stop = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    temperature: Temperature = None
    tool_choice: ToolChoice | None = None  # absent or null: "auto" with tools, else "none"
    tools: list[FunctionTool] | None = None
    top_logprobs: Annotated[int | None, Field(ge=0, le=20)] = None
    top_p: TopP = None
    user: str | None = None
    web_search_options: Any = None

    # --- specserve extensions (vLLM names) ---
    top_k: TopK = None
    min_p: MinP = None
    repetition_penalty: RepetitionPenalty = None
    min_tokens: MinTokens = None
    ignore_eos: bool | None = None
    stop_token_ids: StopTokenIds = None
    skip_special_tokens: bool | None = None
    speculation: SpeculationOptions | None = None

    @field_validator("response_format", mode="before")
    @classmethod
    def _not_null(cls, value: Any, info: ValidationInfo) -> Any:
        return reject_null(value, info)

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise fail("top_logprobs requires logprobs: true", param="top_logprobs")
        return self

    @model_validator(mode="after")
    def _tools_and_choice(self) -> ChatCompletionRequest:
        check_tools(self.tools, self.tool_choice)
        return self


class CompletionRequest(_RequestBase):
    """POST /v1/completions (legacy)."""

    model: str
    prompt: Prompt
    best_of: Annotated[int | None, Field(ge=0, le=20)] = None
    echo: bool | None = None
    frequency_penalty: Penalty = None
    logit_bias: dict[str, float] | None = None
    logprobs: Annotated[int | None, Field(ge=0, le=5)] = None
    max_tokens: PositiveInt = COMPLETIONS_MAX_TOKENS
    n: PositiveInt = None
    presence_penalty: Penalty = None
    seed: Seed = None
    stop: Stop = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    suffix: str | None = None
    temperature: Temperature = None
    top_p: TopP = None
    user: str | None = None

    # --- specserve extensions (vLLM names) ---
    top_k: TopK = None
    min_p: MinP = None
    repetition_penalty: RepetitionPenalty = None
    min_tokens: MinTokens = None
    ignore_eos: bool | None = None
    stop_token_ids: StopTokenIds = None
    skip_special_tokens: bool | None = None
    speculation: SpeculationOptions | None = None
    response_format: ResponseFormat | None = None  # as chat's (vLLM accepts it here too)

    @field_validator("max_tokens")
    @classmethod
    def _null_max_tokens_is_the_default(cls, max_tokens: int | None) -> int:
        # An explicit null means what leaving it out means (16), not "to the end of the context":
        # on this endpoint a client never asks for a whole context by accident.
        return COMPLETIONS_MAX_TOKENS if max_tokens is None else max_tokens

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, echo: bool | None) -> bool | None:
        if echo:
            raise fail("echo is not supported", "unsupported_value")
        return echo

    def num_prompts(self) -> int:
        prompt = self.prompt
        return 1 if isinstance(prompt, str) or isinstance(prompt[0], int) else len(prompt)

    @model_validator(mode="after")
    def _best_of_is_n(self) -> CompletionRequest:
        if self.best_of not in (None, 1, self.n or 1):
            message = "best_of is only supported when it equals n (or 1)"
            raise fail(message, "unsupported_value", param="best_of")
        return self


RequestT = TypeVar("RequestT", ChatCompletionRequest, CompletionRequest)


def parse_request(
    model: type[RequestT], body: bytes | str | Any, limits: RequestLimits | None = None
) -> RequestT:
    """Validate a raw body (bytes or str of JSON) or an already decoded one (`json.loads`
    accepts NaN; the models reject it) under the server's `limits` (default: the defaults).
    Raises `OpenAIError` 400 for any problem."""
    context = {"limits": limits} if limits is not None else None
    try:
        if isinstance(body, (bytes, bytearray, str)):
            return model.model_validate_json(body, context=context)
        if not isinstance(body, Mapping):
            raise invalid_request("The request body must be a JSON object.")
        return model.model_validate(dict(body), context=context)
    except ValidationError as e:
        raise from_validation_error(e) from None


def unknown_fields(obj: BaseModel, prefix: str = "") -> list[str]:
    """Dotted names of the fields a client sent that the models do not know (for logging)."""
    names = [f"{prefix}{name}" for name in obj.model_extra or {}]
    for field in type(obj).model_fields:
        value = getattr(obj, field)
        items = enumerate(value) if isinstance(value, list) else [(None, value)]
        for i, item in items:
            if isinstance(item, BaseModel):
                where = f"{prefix}{field}." if i is None else f"{prefix}{field}.{i}."
                names.extend(unknown_fields(item, where))
    return names
