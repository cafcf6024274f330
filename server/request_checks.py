"""Checks of request values that a pydantic type alone would report poorly.

A union such as `str | list[TextContentPart]` makes pydantic report one error per branch, under
locations like `content.list[TextContentPart].0.type`; these before-validators check the shape
first and raise ONE error with a clear message at the field itself. `fail` builds that error; a
`param` in its context overrides the location (for checks that span several fields). The bounds
on counts are the server's settings (`server/request_limits.py`), read from the validation
context.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationInfo
from pydantic_core import PydanticCustomError

from server.request_limits import limits_of, over

MAX_STOP_CHARS = 512


def fail(message: str, kind: str = "value_error", param: str | None = None) -> PydanticCustomError:
    # The context's `param` overrides the error location (for checks that span fields).
    return PydanticCustomError(kind, message, {"param": param} if param else None)


def reject_unsupported(value: Any, info: ValidationInfo, hint: str = "") -> Any:
    """Any value but null (or "") is a 400; `hint` says what to use instead."""
    if value not in (None, ""):
        detail = f" ({hint})" if hint else ""
        raise fail(f"{info.field_name} is not supported{detail}", "unsupported_parameter")
    return value


def reject_null(value: Any, info: ValidationInfo) -> Any:
    """For fields the OpenAI spec types without null: an explicit null is a 400 (leave it out)."""
    if value is None:
        raise fail(f"{info.field_name} must not be null; leave it out instead")
    return value


def check_text_parts(value: Any) -> Any:
    """A string, or a non-empty list of {"type": "text", "text": str} parts."""
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list) or not value:
        raise fail("must be a string or a non-empty list of text parts")
    for j, part in enumerate(value):
        if not isinstance(part, dict):
            raise fail(f"part {j} must be an object with 'type' and 'text'")
        if part.get("type") != "text":
            kind = "unsupported_value"
            raise fail(f"part {j} has type {part.get('type')!r}; only text is supported", kind)
        if not isinstance(part.get("text"), str):
            raise fail(f"part {j} must have a string 'text'")
    return value


def check_stop(value: Any, info: ValidationInfo) -> Any:
    if value is None:
        return value
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(stop, str) for stop in stops):
        raise fail("must be a string or a list of strings")
    limit = limits_of(info).max_stop_sequences
    if len(stops) > limit:
        raise fail(f"got {len(stops)} stop sequences; {over('max_stop_sequences', limit)}")
    if not all(0 < len(stop) <= MAX_STOP_CHARS for stop in stops):
        raise fail(f"stop sequences must have 1 to {MAX_STOP_CHARS} characters")
    return value


def check_prompt(value: Any, info: ValidationInfo) -> Any:
    """A non-empty string, list of strings, list of token ids, or list of lists of token ids."""
    if isinstance(value, str):
        if not value:
            raise fail("must not be empty")
        return value
    if not isinstance(value, list) or not value:
        raise fail("must be a non-empty string, list of strings or list of token id lists")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        prompts: list[Any] = [value]
    elif all(isinstance(p, (str, list)) for p in value):
        prompts = value
    else:
        raise fail(
            "must be a string, a list of strings, a list of token ids or a list of token id lists"
        )
    limit = limits_of(info).max_prompts_per_request
    if len(prompts) > limit:
        raise fail(f"got {len(prompts)} prompts; {over('max_prompts_per_request', limit)}")
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise fail(f"prompt {i} is empty")
        if isinstance(prompt, list) and not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt
        ):
            raise fail(f"prompt {i} must be a list of non-negative integer token ids")
    if not all(isinstance(p, type(prompts[0])) for p in prompts):
        raise fail("must not mix strings and token id lists")
    return value


def check_logit_bias(
    bias: dict[str, float] | None, info: ValidationInfo
) -> dict[str, float] | None:
    """Token ids as decimal strings -> bias in [-100, 100]; at most max_logit_bias entries."""
    if bias is None:
        return None
    limit = limits_of(info).max_logit_bias
    if len(bias) > limit:
        raise fail(f"got {len(bias)} entries; {over('max_logit_bias', limit)}")
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()):
            raise fail(f"keys must be token ids written as decimal strings, got {key!r}")
        if not -100.0 <= value <= 100.0:
            raise fail(f"values must be in [-100, 100], got {value} for {key!r}")
    return bias
