"""What the engine checks and derives from a request before queueing it: prompt token ids,
the resolved max_tokens, and its compiled grammar."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from engine.structured.compiler import CompiledGrammar, GrammarCompiler
from engine.text.tokenizer import encode_text


def encode_prompt(tokenizer: Any, vocab_size: int, prompt: str | Sequence[int]) -> list[int]:
    """Token ids for a prompt given as text or as ids; validates ids against the vocab."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise InvalidRequestError(
                "this model has no tokenizer: pass prompts as token ids.", "prompt"
            )
        token_ids = encode_text(tokenizer, prompt)
    else:
        token_ids = [int(t) for t in prompt]
    if not token_ids:
        raise InvalidRequestError("the prompt is empty.", "prompt")
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(
            f"prompt token id {bad} is outside the vocabulary (size {vocab_size}).", "prompt"
        )
    return token_ids


def compile_grammar(
    grammars: GrammarCompiler | None, params: SamplingParams
) -> CompiledGrammar | None:
    """The request's compiled grammar, None without one (the server compiled it already, off
    the engine thread, so this is a cache hit; the offline API compiles here)."""
    if params.structured is None:
        return None
    if grammars is None:
        raise InvalidRequestError(
            "structured outputs need the model's tokenizer, and this model has none.",
            "response_format",
        )
    return grammars.compile(params.structured)


def resolve_max_tokens(max_model_len: int, num_prompt_tokens: int, params: SamplingParams) -> int:
    """params.max_tokens, or what the context leaves after the prompt; raises when it cannot fit."""
    room = max_model_len - num_prompt_tokens
    if room < 1:
        raise InvalidRequestError(
            f"the prompt is {num_prompt_tokens} tokens; this model's context is "
            f"{max_model_len} tokens, which leaves no room to generate.",
            "prompt",
        )
    if params.max_tokens is None:
        return room
    if params.max_tokens > room:
        raise InvalidRequestError(
            f"the prompt ({num_prompt_tokens} tokens) plus max_tokens ({params.max_tokens}) "
            f"exceeds this model's context of {max_model_len} tokens.",
            "max_tokens",
        )
    return params.max_tokens
