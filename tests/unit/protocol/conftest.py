"""Fixtures of the protocol tests: the official OpenAPI spec and its JSON Schema validators, and
tokenizers trained here (no downloads). Module-scoped: each test module loads them once.

The spec (vendored in tests/data/openai/, or $SPECSERVE_OPENAPI) has its `$ref`s resolved and
OpenAPI's `nullable: true` rewritten into JSON Schema.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from transformers import PreTrainedTokenizerFast

from tests.openapi_spec import spec_schemas, to_json_schema
from tests.unit.protocol.helpers import train_byte_level


@pytest.fixture(scope="module")
def openapi() -> dict[str, Any]:
    return spec_schemas()


@pytest.fixture(scope="module")
def validators(openapi) -> dict[str, Any]:
    jsonschema = pytest.importorskip("jsonschema")

    def schema_validator(schemas: dict[str, Any], name: str) -> Any:
        schema = to_json_schema(schemas[name], schemas, (name,))
        return jsonschema.Draft202012Validator(schema)

    names = [
        "CreateChatCompletionResponse",
        "CreateChatCompletionStreamResponse",
        "CreateCompletionResponse",
        "ListModelsResponse",
        "ErrorResponse",
    ]
    found = {name: schema_validator(openapi, name) for name in names}
    # The spec shares one schema between completions responses and chunks, but a chunk's
    # finish_reason is null until the last one (as OpenAI streams it): allow null there.
    chunk = copy.deepcopy(openapi["CreateCompletionResponse"])
    chunk["properties"]["choices"]["items"]["properties"]["finish_reason"]["nullable"] = True
    chunk["properties"]["usage"] = {"$ref": "#/x/CompletionUsage", "nullable": True}
    found["CompletionChunk"] = jsonschema.Draft202012Validator(to_json_schema(chunk, openapi))
    return found


@pytest.fixture(scope="module")
def byte_level() -> PreTrainedTokenizerFast:
    return train_byte_level()
