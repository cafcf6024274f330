"""The official OpenAI spec for the tests: where it is, and its schemas as JSON Schema.

The spec is vendored in tests/data/openai/ (MIT, see its LICENSE and README);
$SPECSERVE_OPENAPI points the tests at another copy. It is OpenAPI 3.1 with `nullable: true` in
places; `to_json_schema` resolves `$ref`s and rewrites it.
`strip_spec` cuts it to the two operations the server serves, for schemathesis
(tests/e2e/test_schemathesis.py and bench/reliability/fuzz.py).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from server.chat_messages import ChatMessage, TextContentPart
from server.protocol import ChatCompletionRequest, CompletionRequest

_REPO = Path(__file__).resolve().parents[1]
SPEC_PATH = Path(
    os.environ.get("SPECSERVE_OPENAPI", _REPO / "tests" / "data" / "openai" / "openapi.yaml")
)


def to_json_schema(node: Any, schemas: dict[str, Any], stack: tuple[str, ...] = ()) -> Any:
    """Resolve `$ref`s (a cycle becomes {}) and turn `nullable: true` into anyOf [..., null]."""
    if isinstance(node, list):
        return [to_json_schema(item, schemas, stack) for item in node]
    if not isinstance(node, dict):
        return node
    node = dict(node)
    if "$ref" in node:
        name = node.pop("$ref").rsplit("/", 1)[-1]
        target = {} if name in stack else to_json_schema(schemas[name], schemas, (*stack, name))
        node = {**target, **{k: v for k, v in node.items() if k != "description"}}
    out = {k: to_json_schema(v, schemas, stack) for k, v in node.items() if k != "nullable"}
    if node.get("nullable"):
        return {"anyOf": [out, {"type": "null"}]}
    return out


def load_spec() -> dict[str, Any]:
    """The whole spec, parsed. It is part of the repository: a missing file is an error, not a
    reason to skip."""
    import yaml

    with SPEC_PATH.open(encoding="utf-8") as f:
        return yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def spec_schemas() -> dict[str, Any]:
    """The spec's components.schemas."""
    return load_spec()["components"]["schemas"]


def validators(names: list[str], schemas: dict[str, Any]) -> dict[str, Any]:
    """A JSON Schema validator per named component."""
    import jsonschema

    return {n: jsonschema.Draft202012Validator(to_json_schema(schemas[n], schemas)) for n in names}


def assert_valid(checks: dict[str, Any], name: str, body: Any) -> Any:
    """body, after asserting it validates against the named schema."""
    errors = [f"{list(e.path)}: {e.message}" for e in checks[name].iter_errors(body)]
    assert not errors, errors
    return body


# ----------------------------------------------------------------- the spec cut for fuzzing
# Nested request schemas -> the model that reads them (other properties are not read).
NESTED_MODELS = {
    "ChatCompletionRequestDeveloperMessage": ChatMessage,
    "ChatCompletionRequestSystemMessage": ChatMessage,
    "ChatCompletionRequestUserMessage": ChatMessage,
    "ChatCompletionRequestAssistantMessage": ChatMessage,
    "ChatCompletionRequestToolMessage": ChatMessage,
    "ChatCompletionRequestMessageContentPartText": TextContentPart,
}
# operationId -> (path, our request model: fields it does not declare are not read).
OPERATIONS = {
    "createChatCompletion": ("/chat/completions", ChatCompletionRequest),
    "createCompletion": ("/completions", CompletionRequest),
}


def _refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        if isinstance(node.get("$ref"), str):
            yield node["$ref"].rsplit("/", 1)[-1]
        for value in node.values():
            yield from _refs(value)
    elif isinstance(node, list):
        for item in node:
            yield from _refs(item)


def _flat_request_schema(schema: dict[str, Any], schemas: dict[str, Any]) -> dict[str, Any]:
    """Merge a request schema's top-level `allOf` (recursively) into one object schema."""
    if "$ref" in schema:
        schema = schemas[schema["$ref"].rsplit("/", 1)[-1]]
    merged: dict[str, Any] = {"type": "object", "properties": {}, "required": []}
    for part in schema.get("allOf", []):
        flat = _flat_request_schema(part, schemas)
        merged["properties"].update(flat["properties"])
        merged["required"] += flat["required"]
    merged["properties"].update(copy.deepcopy(schema.get("properties", {})))
    merged["required"] += schema.get("required", [])
    return merged


def _drop_unread(schema: dict[str, Any], model: Any, dropped: list[str]) -> dict[str, Any]:
    """A copy of an object schema (or of each `allOf` part) without the properties `model`
    does not declare; their names are appended to `dropped`."""
    schema = copy.deepcopy(schema)
    for part in schema.get("allOf", [schema]):
        for name in sorted(set(part.get("properties", {})) - set(model.model_fields)):
            del part["properties"][name]
            dropped.append(name)
        if "required" in part:
            part["required"] = [name for name in part["required"] if name in model.model_fields]
    return schema


def _reachable(components: dict[str, Any], root: Any) -> dict[str, set[str]]:
    """The names of the components `root` references, transitively, per section."""
    kept: dict[str, set[str]] = {"schemas": set(), "responses": set()}
    todo = list(_refs(root))
    while todo:
        name = todo.pop()
        for section, names in kept.items():
            if name in components.get(section, {}) and name not in names:
                names.add(name)
                todo.extend(_refs(components[section][name]))
    return kept


def strip_spec(spec: dict[str, Any]) -> tuple[dict[str, Any], dict[str, list[str]]]:
    """The spec cut to the two operations and the components they reach, with the request
    schemas cut to the fields the server reads. Returns (spec, dropped names per schema)."""
    components = spec["components"]
    paths: dict[str, Any] = {}
    dropped: dict[str, list[str]] = {}
    for operation_id, (path, request_model) in OPERATIONS.items():
        operation = copy.deepcopy(spec["paths"][path]["post"])
        operation.pop("x-oaiMeta", None)
        body = operation["requestBody"]["content"]["application/json"]
        flat = _flat_request_schema(body["schema"], components["schemas"])
        body["schema"] = _drop_unread(flat, request_model, dropped.setdefault(operation_id, []))
        paths[path] = {"post": operation}
    kept = _reachable(components, paths)
    stripped_components = {
        section: {name: components[section][name] for name in sorted(names)}
        for section, names in kept.items()
    }
    schemas = stripped_components["schemas"]
    for name, model in NESTED_MODELS.items():
        if name in schemas:
            schemas[name] = _drop_unread(schemas[name], model, dropped.setdefault(name, []))
    stripped = {"openapi": spec["openapi"], "info": spec["info"], "paths": paths}
    return {**stripped, "components": stripped_components}, dropped
