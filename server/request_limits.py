"""Per-request bounds: how much one request may ask of the engine. They are server settings
(`Settings.request_limits()`), each error names the setting that bounds it.

Validation reads them from pydantic's validation context (`parse_request(model, body, limits)`;
without one, the defaults): the prompt list, stop strings and logit_bias entries of a body, and
the sequences it fans out into — a chat request n, a completions request prompts x n — are
bounded before anything runs.

The tokens a request may ask for are bounded once its prompts are known, still as a 400 before
any stream starts. A request asks for the sum over its sequences of their effective max_tokens:
the max_tokens (or max_completion_tokens) it gives, or for a chat request without one the context
left after its prompt (max_model_len - prompt tokens), which is how far the engine lets it go.
/v1/completions always has a max_tokens (absent or null is 16), so its count needs no prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from pydantic import ValidationInfo

from server.errors import invalid_request

# The default token budget, in contexts: 8 sequences that each may run to the end of the context
# (a chat with n up to 8 and no max_tokens), on whatever model is served.
CONTEXTS_PER_REQUEST = 8


@dataclass(frozen=True)
class RequestLimits:
    """The bounds on one request; the field names are the settings' (`server/settings.py`)."""

    max_prompts_per_request: int = 64
    max_stop_sequences: int = 4
    max_logit_bias: int = 300
    max_sequences_per_request: int = 64
    max_tokens_per_request: int | None = None  # None: CONTEXTS_PER_REQUEST x max_model_len

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and value < 1:
                raise ValueError(f"{f.name} must be at least 1, got {value}")

    def token_budget(self, max_model_len: int) -> int:
        if self.max_tokens_per_request is not None:
            return self.max_tokens_per_request
        return CONTEXTS_PER_REQUEST * max_model_len


DEFAULT_LIMITS = RequestLimits()


def limits_of(info: ValidationInfo | None) -> RequestLimits:
    """The limits `parse_request` was given, else the defaults."""
    context: Any = info.context if info is not None else None
    limits = context.get("limits") if isinstance(context, dict) else None
    return limits if isinstance(limits, RequestLimits) else DEFAULT_LIMITS


def over(setting: str, limit: int) -> str:
    """The end of a message about a value over a limit: which setting says so."""
    return f"at most {limit} per request (the server's {setting} setting)"


def num_sequences_error(num_prompts: int, n: int, limits: RequestLimits) -> str | None:
    """The message for a request fanning out into too many sequences, or None."""
    num_sequences = num_prompts * n
    if num_sequences <= limits.max_sequences_per_request:
        return None
    what = f"{num_prompts} prompts x n={n}" if num_prompts > 1 else f"n={n}"
    return f"this request asks for {num_sequences} sequences ({what}); " + over(
        "max_sequences_per_request", limits.max_sequences_per_request
    )


def check_requested_tokens(
    limits: RequestLimits,
    max_model_len: int,
    *,
    n: int,
    max_tokens: int | None,
    prompt_lens: Sequence[int],
    param: str,
) -> None:
    """400 naming `param` when the request's sequences (each prompt n times) may generate more
    tokens than the budget; `max_tokens` None counts the context left after each prompt."""
    if max_tokens is not None:
        per_prompt = [max_tokens] * len(prompt_lens)
    else:
        per_prompt = [max(0, max_model_len - prompt_len) for prompt_len in prompt_lens]
    num_tokens = n * sum(per_prompt)
    budget = limits.token_budget(max_model_len)
    if num_tokens > budget:
        counted = "max_tokens" if max_tokens is not None else "the context left after the prompt"
        raise invalid_request(
            f"This request may generate up to {num_tokens} tokens ({counted} for each of its "
            f"{n * len(prompt_lens)} sequences); {over('max_tokens_per_request', budget)}.",
            param,
        )
