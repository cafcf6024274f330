"""The messages of a chat request (pydantic v2): system, developer, user, assistant (text and
tool calls) and tool (a call's result), with text content only.

An assistant message may leave its content out (or null) when it carries tool calls; a tool
message needs `tool_call_id`. The deprecated `function` role and an assistant's
`function_call` are 400s (use `tool` messages and `tool_calls`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator

from server.request_checks import check_text_parts, fail, reject_null, reject_unsupported
from server.tool_protocol import MessageToolCall

_STRICT = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


class TextContentPart(BaseModel):
    """`{"type": "text", "text": ...}`: the only content part this server reads."""

    model_config = _STRICT
    type: Literal["text"]
    text: str


TextOrParts = Annotated[str | list[TextContentPart], BeforeValidator(check_text_parts)]


class ChatMessage(BaseModel):
    """One input message. Fields are declared in the order their checks need: a check reads
    the fields declared before it."""

    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    function_call: Any = None
    # Checked even when absent: a tool message needs one, an assistant message may lack content.
    tool_call_id: Annotated[str | None, Field(validate_default=True)] = None
    content: Annotated[TextOrParts | None, Field(validate_default=True)] = None

    @field_validator("role", mode="before")
    @classmethod
    def _deprecated_role(cls, role: Any) -> Any:
        if role == "function":
            message = "role 'function' is deprecated and not supported; use 'tool' messages"
            raise fail(message, "unsupported_value")
        return role

    @field_validator("name", mode="before")
    @classmethod
    def _not_null(cls, value: Any, info: ValidationInfo) -> Any:
        return reject_null(value, info)

    @field_validator("tool_calls")
    @classmethod
    def _assistant_calls(
        cls, calls: list[MessageToolCall] | None, info: ValidationInfo
    ) -> list[MessageToolCall] | None:
        if calls and info.data.get("role") != "assistant":
            raise fail("only assistant messages have tool_calls")
        return calls

    @field_validator("function_call")
    @classmethod
    def _no_function_call(cls, value: Any, info: ValidationInfo) -> Any:
        return reject_unsupported(value, info, "deprecated: use tool_calls")

    @field_validator("tool_call_id")
    @classmethod
    def _tool_call_id(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None and info.data.get("role") == "tool":
            raise fail("a tool message needs the tool_call_id of the call it answers")
        return value

    @field_validator("content")
    @classmethod
    def _content_present(cls, content: Any, info: ValidationInfo) -> Any:
        if content is None and not (
            info.data.get("role") == "assistant" and info.data.get("tool_calls")
        ):
            raise fail(f"{info.data.get('role', 'message')} content must be text")
        return content

    def for_template(self) -> dict[str, Any]:
        """The message as `engine.text.tokenizer.apply_chat_template` takes it: role, content (text
        or plain-dict parts; None for an assistant turn of calls only), and the tool fields."""
        content = self.content
        message: dict[str, Any] = {
            "role": self.role,
            "content": content
            if content is None or isinstance(content, str)
            else [part.model_dump(include={"type", "text"}) for part in content],
        }
        if self.tool_calls:
            message["tool_calls"] = [call.for_template() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message
