"""The official OpenAI spec for the tests: where it is, and its schemas as JSON Schema.

`../shared/openai/openapi.yaml` beside the repository (or $SPECSERVE_OPENAPI). The spec is
OpenAPI 3.1 with `nullable: true` in places; `to_json_schema` resolves `$ref`s and rewrites it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[1]
SPEC_PATH = Path(
    os.environ.get("SPECSERVE_OPENAPI", _REPO.parent / "shared" / "openai" / "openapi.yaml")
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


def spec_schemas() -> dict[str, Any]:
    """The spec's components.schemas; skips the calling test when the spec is not there."""
    import pytest
    import yaml

    if not SPEC_PATH.is_file():
        pytest.skip(f"OpenAPI spec not found at {SPEC_PATH}")
    with SPEC_PATH.open(encoding="utf-8") as f:
        spec = yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    return spec["components"]["schemas"]


def validators(names: list[str], schemas: dict[str, Any]) -> dict[str, Any]:
    """A JSON Schema validator per named component."""
    import jsonschema

    return {n: jsonschema.Draft202012Validator(to_json_schema(schemas[n], schemas)) for n in names}


def assert_valid(checks: dict[str, Any], name: str, body: Any) -> Any:
    """body, after asserting it validates against the named schema."""
    errors = [f"{list(e.path)}: {e.message}" for e in checks[name].iter_errors(body)]
    assert not errors, errors
    return body
