"""OpenAI error envelopes: `{"error": {"message", "type", "param", "code"}}` with an HTTP status.

Routes raise `OpenAIError`; one exception handler turns it into a JSON response with
`error.status`, `error.body()` and `error.headers`. Builders below cover every status the server
returns. A 500 never carries exception text: internals stay in the server log.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Mapping
from typing import Any

from pydantic import ValidationError

INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
RATE_LIMIT = "rate_limit_error"
SERVER_ERROR = "server_error"

# Pydantic names union branches and wrapped types in error locations ('str', 'list[int]',
# 'function-after[...]', a class name); those are not parameters a client wrote.
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "[key]"})
_MAX_INPUT_CHARS = 40
# "messages[0].role must be ..." -> "messages.0.role"
_LEADING_PARAM = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*(?:\[\d+\]|\.[A-Za-z0-9_]+)*)\s")


class OpenAIError(Exception):
    """An error a route returns to the client as an OpenAI error envelope."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers: dict[str, str] = dict(headers or {})

    def body(self) -> dict[str, dict[str, str | None]]:
        return error_body(self.message, self.type, self.param, self.code)

    def __repr__(self) -> str:
        return f"OpenAIError({self.status}, {self.message!r}, param={self.param!r})"


def error_body(
    message: str, type: str = INVALID_REQUEST, param: str | None = None, code: str | None = None
) -> dict[str, dict[str, str | None]]:
    """The JSON body of an error response, as the OpenAI API shapes it."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    """400: the request is malformed or asks for something this server cannot do."""
    return OpenAIError(400, message, INVALID_REQUEST, param, code)


def authentication_error(message: str = "Incorrect API key provided.") -> OpenAIError:
    """401: a missing or wrong API key."""
    return OpenAIError(401, message, AUTHENTICATION, None, "invalid_api_key")


def model_not_found(model: str) -> OpenAIError:
    """404 for a model name this server does not serve."""
    message = f"The model `{model}` does not exist or you do not have access to it."
    return OpenAIError(404, message, INVALID_REQUEST, "model", "model_not_found")


def not_found(message: str = "Not found.") -> OpenAIError:
    """404 for an unknown path or object."""
    return OpenAIError(404, message, INVALID_REQUEST, None, "not_found")


def request_too_large(max_bytes: int) -> OpenAIError:
    """413: the request body is over the server's limit (the connection closes after it)."""
    message = f"The request body is larger than the limit of {max_bytes} bytes (max_body_bytes)."
    headers = {"Connection": "close"}
    return OpenAIError(413, message, INVALID_REQUEST, None, "request_too_large", headers)


def request_timeout(seconds: float) -> OpenAIError:
    """408: the request body did not arrive in time (the connection closes after it)."""
    message = f"The request body was not received within {seconds:g} s (body_timeout)."
    headers = {"Connection": "close"}
    return OpenAIError(408, message, INVALID_REQUEST, None, "request_timeout", headers)


def rate_limited(retry_after_s: float, message: str | None = None) -> OpenAIError:
    """429 for a client over its rate limit; `Retry-After` tells it when to come back."""
    message = message or "Rate limit reached. Please retry after a short wait."
    headers = {"Retry-After": str(max(1, math.ceil(retry_after_s)))}
    return OpenAIError(429, message, RATE_LIMIT, None, "rate_limit_exceeded", headers)


def server_overloaded(retry_after_s: float, status: int = 429) -> OpenAIError:
    """429 (or 503) when the engine's queue is full; `Retry-After` says when to retry."""
    if status not in (429, 503):
        raise ValueError(f"an overload is reported as 429 or 503, not {status}.")
    message = "The server is currently overloaded with other requests. Please retry later."
    headers = {"Retry-After": str(max(1, math.ceil(retry_after_s)))}
    return OpenAIError(status, message, SERVER_ERROR, None, "server_overloaded", headers)


def engine_unavailable() -> OpenAIError:
    """503 for an engine that is loading, shutting down or dead (no internals in the message)."""
    message = "The engine is not serving requests right now (loading or shutting down)."
    return OpenAIError(503, message, SERVER_ERROR, None, "engine_unavailable", {"Retry-After": "5"})


def internal_error(request_id: str | None = None) -> OpenAIError:
    """500 with a fixed message: the exception itself is for the log, not for the client."""
    message = "The server had an error while processing your request."
    if request_id:
        message += f" Request id: {request_id}."
    return OpenAIError(500, message, SERVER_ERROR, None, None)


def from_value_error(
    exc: ValueError, known_params: Collection[str] = (), aliases: Mapping[str, str] | None = None
) -> OpenAIError:
    """400 from a `ValueError` raised by the engine or `to_sampling_params`.

    The engine's `InvalidRequestError` names its field (`param`, renamed through `aliases`, e.g.
    the engine's "prompt" is a chat request's "messages"). Other messages start with the offending
    field ("n must be at least 1", "messages[0].role must be ..."); when that first word names one
    of `known_params` it becomes `param`.
    """
    message = str(exc) or "Invalid request."
    named = getattr(exc, "param", None)
    if named is not None:
        return invalid_request(message, (aliases or {}).get(named, named))
    param = None
    match = _LEADING_PARAM.match(message)
    if match and re.split(r"[.\[]", match.group(1))[0] in known_params:
        param = re.sub(r"\[(\d+)\]", r".\1", match.group(1))
    return invalid_request(message, param)


def from_validation_error(exc: ValidationError) -> OpenAIError:
    """400 naming the first offending field of a pydantic `ValidationError` as `param`."""
    errors = exc.errors(include_url=False)
    if not errors:
        return invalid_request("Invalid request body.")
    error = errors[0]
    kind = error.get("type", "")
    if kind == "json_invalid":
        detail = error.get("ctx", {}).get("error", "")
        return invalid_request(f"The request body is not valid JSON ({detail}).", None)
    loc = _clean_loc(error.get("loc", ()))
    ctx = error.get("ctx") or {}
    param = ctx.get("param") or (".".join(str(part) for part in loc) or None)
    if kind == "model_type" and not loc:
        return invalid_request("The request body must be a JSON object.", None)
    message = error.get("msg", "Invalid value")
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        message = "Input should be a JSON object"  # not pydantic's "...or instance of <class>"
    elif _is_scalar(error.get("input")) and not kind.startswith("unsupported"):
        message = f"{message}; got {_short_repr(error.get('input'))}"
    where = f"Invalid '{param}': " if param else "Invalid request: "
    code = kind if kind in ("unsupported_parameter", "unsupported_value") else None
    return invalid_request(f"{where}{message}.", param, code)


def _clean_loc(loc: tuple[Any, ...]) -> list[str | int]:
    return [part for part in loc if isinstance(part, int) or not _is_type_tag(part)]


def _is_type_tag(part: str) -> bool:
    return part in _TYPE_TAGS or "[" in part or "-" in part or part[:1].isupper()


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def _short_repr(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    text = f'"{value}"' if isinstance(value, str) else repr(value)
    return text if len(text) <= _MAX_INPUT_CHARS else text[: _MAX_INPUT_CHARS - 3] + "..."
