"""`response_format`: plain text, any JSON object, or an instance of a JSON schema (OpenAI's
`ResponseFormatText`, `ResponseFormatJsonObject`, `ResponseFormatJsonSchema`), and the engine's
`StructuredOutput` for it.

Accepted on both endpoints (on /v1/completions as an extension, as vLLM does). A json_schema
without `schema` means any JSON object. `strict` is accepted either way: the output always
matches the schema exactly (no keys beyond its properties unless it allows them), which is what
strict asks for. Whether the grammar library can use a schema is checked when the server compiles
it (`GrammarWorker`), still a 400 before anything runs.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.errors import InvalidRequestError
from engine.structured import StructuredOutput
from engine.structured.compiler import GrammarCompiler
from server.errors import OpenAIError, invalid_request
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


class GrammarWorker:
    """Compiles requests' constraints on a thread of its own: never on the asyncio loop (a big
    schema takes seconds) and never on the engine thread, which then finds it in the compiler's
    cache. One thread: a client sending huge schemas queues behind itself, not ahead of
    tokenisation."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        self._compiler = compiler
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")

    async def compile(self, structured: StructuredOutput, param: str = "response_format") -> None:
        """Compile (or find cached); a constraint the grammar library cannot use is a 400."""
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self._pool, self._compiler.compile, structured, param)
        except InvalidRequestError as e:
            raise _invalid(e) from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _invalid(e: InvalidRequestError) -> OpenAIError:
    return invalid_request(str(e), e.param, code="invalid_schema")
