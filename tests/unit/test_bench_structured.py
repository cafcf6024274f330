"""bench/structured_workload.py (the cases of bench/grammar_mask.py and bench/structured.py):
every reference object is valid against its schema, and its compact JSON is what the engine's
grammar (xgrammar, the engine's separators, no other whitespace) accepts."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.unit.bench_scripts import load_bench_script

(W,) = load_bench_script("structured_workload.py")


def test_cases_are_distinct_and_their_references_match_their_schemas():
    assert len({case.name for case in W.CASES}) == len(W.CASES) >= 5
    for case in W.CASES:
        jsonschema.Draft202012Validator.check_schema(case.schema)
        jsonschema.validate(case.reference, case.schema)
        # schema-heavy: nested objects or arrays of objects, and an enum, in every case
        text = json.dumps(case.schema)
        assert '"enum"' in text and text.count('"type": "object"') >= 2, case.name


def test_a_reference_with_a_key_missing_or_added_is_invalid():
    case = W.CASES[0]
    first = next(iter(case.reference))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({k: v for k, v in case.reference.items() if k != first}, case.schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**case.reference, "extra": 1}, case.schema)


def test_the_engine_grammar_accepts_each_reference_in_canonical_json():
    xgrammar = pytest.importorskip("xgrammar")
    # Character-level matching does not depend on the vocabulary: a tiny one will do.
    info = xgrammar.TokenizerInfo(["a", "b", "<eos>"], stop_token_ids=[2])
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    for case in W.CASES:
        compiled = compiler.compile_json_schema(
            json.dumps(case.schema), any_whitespace=False, separators=W.SEPARATORS
        )
        matcher = xgrammar.GrammarMatcher(compiled)
        assert matcher.accept_string(W.canonical_json(case.reference)), case.name
        assert matcher.accept_token(2) and matcher.is_terminated()
        other = xgrammar.GrammarMatcher(compiled)
        assert not other.accept_string(W.canonical_json(case.reference, (",", ":")))


def test_messages_hold_the_instruction_the_schema_and_the_passage():
    case = W.CASES[1]
    (message,) = case.messages()
    assert message["role"] == "user"
    content = message["content"]
    assert content.startswith(case.instruction)
    assert json.dumps(case.schema, ensure_ascii=False) in content
    assert content.endswith(case.passage)
    assert W.canonical_json({"a": [1, "é"]}) == '{"a": [1, "é"]}'
