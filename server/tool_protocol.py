"""Tool calling in chat request bodies: `tools`, `tool_choice`, and the tool calls of earlier
assistant turns (OpenAI's ChatCompletionTool, ChatCompletionToolChoiceOption,
ChatCompletionMessageToolCall). `server/protocol.py` declares the fields with these types.

Only function tools exist here: custom tools, `allowed_tools` choices and custom tool calls are
400s (unsupported). A function's name follows the spec (1 to 64 of a-z, A-Z, 0-9, _ and -).
A past call's `arguments` must be a JSON object (chat templates render it as one).
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, field_validator

from server.request_checks import fail

_STRICT = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
TOOL_CHOICE_MODES = ("none", "auto", "required")


def _function_type(kind: Any, what: str) -> Any:
    """Only function tools: other types the spec knows are unsupported, not malformed."""
    if isinstance(kind, str) and kind != "function":
        raise fail(
            f"{what} of type {kind!r} are not supported (only 'function')", "unsupported_value"
        )
    return kind


class FunctionDefinition(BaseModel):
    """A function the model may call; no `parameters` means it takes none."""

    model_config = _STRICT
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _valid_name(cls, name: str) -> str:
        if not _NAME.fullmatch(name):
            raise fail("a function name has 1 to 64 characters of a-z, A-Z, 0-9, _ and -")
        return name

    def parameters_schema(self) -> dict[str, Any]:
        """The arguments' JSON schema (an empty object when the function takes none)."""
        if self.parameters is None:
            return {"type": "object", "properties": {}}
        return self.parameters

    def for_template(self) -> dict[str, Any]:
        """As a chat template reads it: name, description, parameters (`strict` is the
        server's business, not the model's)."""
        return self.model_dump(include={"name", "description", "parameters"}, exclude_none=True)


class FunctionTool(BaseModel):
    """`{"type": "function", "function": {...}}`."""

    model_config = _STRICT
    type: Literal["function"]
    function: FunctionDefinition

    @field_validator("type", mode="before")
    @classmethod
    def _only_functions(cls, kind: Any) -> Any:
        return _function_type(kind, "tools")


class FunctionName(BaseModel):
    """The function a named tool choice forces."""

    model_config = _STRICT
    name: str


class NamedToolChoice(BaseModel):
    """`{"type": "function", "function": {"name": ...}}`: call this function."""

    model_config = _STRICT
    type: Literal["function"]
    function: FunctionName


def _check_tool_choice(value: Any) -> Any:
    # One clear error instead of one per branch of the union.
    modes = ", ".join(repr(m) for m in TOOL_CHOICE_MODES)
    expected = f"must be {modes} or {{'type': 'function', 'function': {{'name': ...}}}}"
    if isinstance(value, str) and value not in TOOL_CHOICE_MODES:
        raise fail(expected)
    if isinstance(value, dict):
        kind = value.get("type")
        if kind in ("allowed_tools", "custom"):
            raise fail(f"tool_choice {kind!r} is not supported", "unsupported_value")
        function = value.get("function")
        if kind != "function" or not isinstance(function, dict):
            raise fail(expected)
        if not isinstance(function.get("name"), str):
            raise fail("a named tool choice needs the function's name, a string")
    elif value is not None and not isinstance(value, str):
        raise fail(expected)
    return value


ToolChoice = Annotated[
    Literal["none", "auto", "required"] | NamedToolChoice, BeforeValidator(_check_tool_choice)
]


class CalledFunction(BaseModel):
    """A past call's function: its name and its arguments, a JSON object written as text."""

    model_config = _STRICT
    name: str
    arguments: str

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, arguments: str) -> str:
        try:
            value = json.loads(arguments)
        except ValueError as e:
            raise fail(f"must be a JSON object written as a string; it is not JSON: {e}") from None
        if not isinstance(value, dict):
            raise fail("must be a JSON object written as a string")
        return arguments

    def for_template(self) -> dict[str, Any]:
        """Arguments as a dict: chat templates write them with `tojson`."""
        return {"name": self.name, "arguments": json.loads(self.arguments)}


class MessageToolCall(BaseModel):
    """A tool call of an earlier assistant turn."""

    model_config = _STRICT
    id: str
    type: Literal["function"]
    function: CalledFunction

    @field_validator("type", mode="before")
    @classmethod
    def _only_functions(cls, kind: Any) -> Any:
        return _function_type(kind, "tool calls")

    def for_template(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": self.function.for_template()}


def check_tools(
    tools: list[FunctionTool] | None, tool_choice: str | NamedToolChoice | None
) -> None:
    """What spans both fields: unique names, and a tool choice the tools can satisfy. `none`
    is the one choice that needs no tools (it is what their absence means)."""
    names = [tool.function.name for tool in tools or []]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise fail(
            f"function names must be unique; repeated: {', '.join(duplicates)}", param="tools"
        )
    if tool_choice in (None, "none"):
        return
    if not names:
        raise fail("tool_choice is only allowed when tools are given", param="tool_choice")
    if isinstance(tool_choice, NamedToolChoice) and tool_choice.function.name not in names:
        message = f"tool_choice names the function {tool_choice.function.name!r}, not in tools"
        raise fail(message, param="tool_choice")
