"""Schema keywords the grammar cannot enforce are refused, by name and place; and each one that
is refused really is unenforced by the grammar library (a document breaking it is accepted), so
the list stays honest if the library learns one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.errors import InvalidRequestError
from engine.structured import StructuredOutput
from engine.structured.schema_check import unenforced_keyword

# keyword -> (a schema using it, a document that breaks it)
UNENFORCED = {
    "not": ({"type": "integer", "not": {"const": 1}}, "1"),
    "if": (
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "if": {"required": ["a"]},
            "then": {"required": ["b"]},
        },
        '{"a": 1}',
    ),
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 1]"),
    "contains": ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 2}}, "[1]"),
    "dependentRequired": (
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "dependentRequired": {"a": ["b"]},
        },
        '{"a": 1}',
    ),
    "allOf": ({"allOf": [{"type": "integer"}, {"minimum": 2}]}, "1"),
}


@pytest.fixture(scope="module")
def compiler():
    from engine.models.bundled import resolve_model
    from engine.structured.compiler import GrammarCompiler
    from engine.text.tokenizer import load_tokenizer

    try:
        path = Path(resolve_model("smollm2-135m-instruct"))
    except Exception as e:  # `specserve install-model smollm2-135m-instruct`
        pytest.skip(f"the bundled SmolLM2 tokenizer is not available: {e}")
    return GrammarCompiler(load_tokenizer(path), 49152, [2])


def test_nested_keywords_are_found_with_their_place() -> None:
    schema = {
        "type": "object",
        "properties": {"a": {"type": "array", "items": {"$ref": "#/$defs/x"}}},
        "$defs": {"x": {"anyOf": [{"type": "string"}, {"type": "array", "uniqueItems": True}]}},
    }
    assert unenforced_keyword(schema) == "'uniqueItems' at #/$defs/x/anyOf/1"
    assert unenforced_keyword({"allOf": [{"type": "integer"}]}) is None  # one schema: exact
    assert unenforced_keyword({"type": "array", "uniqueItems": False}) is None
    assert unenforced_keyword({"type": "string", "format": "password"}) is None  # annotation


@pytest.mark.parametrize("keyword", list(UNENFORCED))
def test_a_refused_keyword_is_a_400_naming_it(compiler, keyword: str) -> None:
    schema, _ = UNENFORCED[keyword]
    with pytest.raises(InvalidRequestError, match=keyword) as e:
        compiler.compile(StructuredOutput.json_schema(schema), param="response_format")
    assert e.value.param == "response_format"


@pytest.mark.parametrize("keyword", list(UNENFORCED))
def test_the_library_really_does_not_enforce_it(compiler, keyword: str) -> None:
    import xgrammar

    schema, breaking = UNENFORCED[keyword]
    xgr_compiler, _ = compiler._xgrammar_compiler()
    grammar = xgr_compiler.compile_json_schema(
        json.dumps(schema), any_whitespace=False, separators=(", ", ": ")
    )
    matcher = xgrammar.GrammarMatcher(grammar)
    assert matcher.accept_string(breaking) and matcher.is_completed()
