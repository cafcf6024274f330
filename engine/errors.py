"""Errors the engine raises for requests it cannot serve."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request the engine cannot serve; `param` names the offending request field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
