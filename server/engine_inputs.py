"""What the engine takes from a validated request: sampling parameters, prompts and prediction.

`to_sampling_params` maps OpenAI names onto `engine.sampling_params.SamplingParams` and raises
`ValueError` (naming the field first, so `errors.from_value_error` finds `param`) for what the
engine rejects. Mappings that are not one-to-one:
- chat: `max_completion_tokens` wins over the deprecated `max_tokens`; neither ->
  `default_max_tokens` (None: up to the context length, checked by the engine). Completions'
  `max_tokens` is never None (absent or null is 16: `protocol.COMPLETIONS_MAX_TOKENS`).
- `temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty` absent or null -> the model's
  default for that field (`defaults`: its generation_config.json, unless the server's
  `generation_config` setting is none), else OpenAI's (temperature 1, top_p 1) or the
  extension's neutral value (top_k off, min_p 0, repetition_penalty 1). Field by field: a
  request that sets only a temperature still gets the model's top_p.
- `top_p: 0` keeps only the most likely token, i.e. greedy: temperature 0, top_p 1.
- A negative seed maps into [0, 2**64) by two's complement.
- chat `logprobs: true` + `top_logprobs: k` -> `logprobs=k` (0 when absent); completions
  `logprobs: k` -> `logprobs=k`.
- `speculation.enabled` -> `speculate`, `speculation.max_draft_tokens` -> `max_draft_tokens`
  (absent: speculate, no cap). `speculation.return_stats` is for the response builders:
  `wants_spec_stats`.
- `response_format` json_object / json_schema -> `structured` (a `StructuredOutput`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar, cast, overload

from engine.models.generation_defaults import GenerationDefaults
from engine.sampling_params import SamplingParams
from server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SpeculationOptions,
)

_SEED_MODULUS = 2**64
NO_DEFAULTS = GenerationDefaults()  # a model without sampling defaults
T = TypeVar("T", int, float)


def to_sampling_params(
    req: ChatCompletionRequest | CompletionRequest,
    *,
    default_max_tokens: int | None,
    defaults: GenerationDefaults = NO_DEFAULTS,
) -> SamplingParams:
    """The engine's sampling parameters for one request, the model's `defaults` filling the
    sampling fields it leaves out. Raises ValueError on invalid combos."""
    if isinstance(req, ChatCompletionRequest):
        max_tokens = req.max_completion_tokens
        if max_tokens is None:
            max_tokens = req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        max_tokens = req.max_tokens
        logprobs = req.logprobs
    if max_tokens is None:
        max_tokens = default_max_tokens
    temperature = _first_given(req.temperature, defaults.temperature, 1.0)
    top_p = _first_given(req.top_p, defaults.top_p, 1.0)
    if top_p == 0.0:
        temperature, top_p = 0.0, 1.0
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    speculation = req.speculation or SpeculationOptions()
    return SamplingParams(
        n=req.n or 1,
        temperature=temperature,
        top_p=top_p,
        top_k=_first_given(req.top_k, defaults.top_k, 0),
        min_p=_first_given(req.min_p, defaults.min_p, 0.0),
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=_first_given(req.repetition_penalty, defaults.repetition_penalty, 1.0),
        seed=None if req.seed is None else req.seed % _SEED_MODULUS,
        stop=tuple(stop),
        stop_token_ids=tuple(req.stop_token_ids or ()),
        max_tokens=max_tokens,
        min_tokens=req.min_tokens or 0,
        logprobs=logprobs,
        ignore_eos=bool(req.ignore_eos),
        logit_bias={int(k): v for k, v in (req.logit_bias or {}).items()},
        skip_special_tokens=req.skip_special_tokens is not False,
        speculate=speculation.enabled,
        max_draft_tokens=speculation.max_draft_tokens,
        structured=req.response_format.structured() if req.response_format else None,
    )


def _first_given(requested: T | None, model_default: T | None, fallback: T) -> T:
    if requested is not None:
        return requested
    return fallback if model_default is None else model_default


def wants_spec_stats(req: ChatCompletionRequest | CompletionRequest, server_default: bool) -> bool:
    """Whether each choice reports `speculative_decoding_stats`: the server's setting turns them
    on for every request; otherwise the request opts in with `speculation.return_stats`."""
    return server_default or (req.speculation is not None and req.speculation.return_stats)


@overload
def prompt_of(req: ChatCompletionRequest) -> list[dict[str, Any]]: ...
@overload
def prompt_of(req: CompletionRequest) -> list[str] | list[list[int]]: ...


def prompt_of(
    req: ChatCompletionRequest | CompletionRequest,
) -> list[dict[str, Any]] | list[str] | list[list[int]]:
    """Chat: the messages for `engine.text.tokenizer.apply_chat_template` (role, text content with
    parts as plain dicts, tool calls and tool_call_id). Completions: one entry per prompt, text
    or token ids (a flat id list is ONE prompt). The route submits each completions prompt as
    its own engine request."""
    if isinstance(req, ChatCompletionRequest):
        return messages_of(req.messages)
    prompt = req.prompt
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt[0], int):
        return [cast(list[int], list(prompt))]
    return cast(list[str] | list[list[int]], list(prompt))


def messages_of(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """Validated messages as `engine.text.tokenizer.apply_chat_template` takes them: role, text
    content (a string, or its parts as plain dicts), tool calls and tool_call_id."""
    return [m.for_template() for m in messages]


def prediction_of(req: ChatCompletionRequest) -> str | None:
    """The predicted output's text (text parts concatenated), or None."""
    if req.prediction is None:
        return None
    content = req.prediction.content
    return content if isinstance(content, str) else "".join(part.text for part in content)
