"""Structured outputs in request bodies, the `response_format` field: plain text, any JSON
object, or an instance of a JSON schema (OpenAI's `ResponseFormatText`, `ResponseFormatJsonObject`,
`ResponseFormatJsonSchema`), and the engine's `StructuredOutput` for it. `server/protocol.py`
declares the field with this type.

Accepted on both endpoints (on /v1/completions as an extension, as vLLM does). A json_schema
without `schema` means any JSON object. `strict` is accepted either way: the output always
matches the schema exactly (no keys beyond its properties unless it allows them), which is what
strict asks for. Whether the grammar library can use a schema is checked when the server compiles
it (`server/grammar_worker.py`), still a 400 before anything runs.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.structured import StructuredOutput
from server.request_checks import fail

_STRICT = ConfigDict(strict=True, extra="allow", allow_inf_nan=False, populate_by_name=True)


class JsonSchemaFormat(BaseModel):
    """`response_format.json_schema`: the schema the output must be an instance of."""

    model_config = _STRICT
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """`response_format`: `text` (the default), `json_object` or `json_schema`."""

    model_config = _STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise fail("a json_schema response_format needs its json_schema object")
        if self.type != "json_schema" and self.json_schema is not None:
            raise fail(f"json_schema is only read with type 'json_schema', not {self.type!r}")
        return self

    def structured(self) -> StructuredOutput | None:
        """The engine's constraint for this format (None: plain text)."""
        if self.type == "json_object":
            return StructuredOutput.json_object()
        if self.type == "json_schema":
            assert self.json_schema is not None
            schema = self.json_schema.schema_
            if schema is None:
                return StructuredOutput.json_object()
            return StructuredOutput.json_schema(json.dumps(schema, ensure_ascii=False))
        return None
