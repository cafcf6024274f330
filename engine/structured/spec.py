"""`StructuredOutput`: what a request's output must match."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

StructuredKind = Literal["json_object", "json_schema", "structural_tag"]


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on one request's output.

    kind:
    - "json_object": any JSON object (OpenAI's `response_format: {"type": "json_object"}`).
    - "json_schema": an instance of the JSON schema in `spec` (JSON text).
    - "structural_tag": `spec` is a structural-tag description (JSON text, xgrammar's format:
      tagged segments with JSON-schema content, e.g. `<tool_call>` blocks of a tool-calling
      model); used for `tool_choice` "required" and named functions.

    Output is compact and never loops on whitespace: JSON separators are fixed (", " and ": ")
    and no whitespace is allowed elsewhere.
    """

    kind: StructuredKind
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in ("json_object", "json_schema", "structural_tag"):
            raise ValueError(f"structured output kind {self.kind!r} is not supported.")
        if self.kind == "json_object":
            if self.spec:
                raise ValueError("a json_object constraint takes no spec.")
            return
        try:
            value = json.loads(self.spec)
        except ValueError as e:
            raise ValueError(f"the {self.kind} is not valid JSON: {e}.") from None
        if not isinstance(value, dict) and not (self.kind == "json_schema" and value is True):
            raise ValueError(f"the {self.kind} must be a JSON object.")

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str) -> StructuredOutput:
        """An instance of `schema` (a dict or its JSON text). Property order is kept: it is the
        order the output's keys come in."""
        text = schema if isinstance(schema, str) else json.dumps(schema, ensure_ascii=False)
        return cls("json_schema", text)

    @classmethod
    def json_object(cls) -> StructuredOutput:
        return cls("json_object")

    @classmethod
    def structural_tag(cls, tag: dict[str, Any] | str) -> StructuredOutput:
        text = tag if isinstance(tag, str) else json.dumps(tag, ensure_ascii=False)
        return cls("structural_tag", text)
