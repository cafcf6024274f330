"""bench/structured/workload.py (the cases of bench/structured/grammar_mask.py and
bench/structured/run.py): every reference object is valid against its schema, and its compact
JSON is what the engine's grammar (xgrammar, the engine's separators, no other whitespace)
accepts."""

from __future__ import annotations

import json

import jsonschema
import pytest

from bench.structured import report as R
from bench.structured import workload as W


def test_cases_are_distinct_and_their_references_match_their_schemas():
    assert len({case.name for case in W.CASES}) == len(W.CASES) >= 5
    for case in W.CASES:
        jsonschema.Draft202012Validator.check_schema(case.schema)
        jsonschema.validate(case.reference, case.schema)
        # schema-heavy: nested objects or arrays of objects, and an enum, in every case
        text = json.dumps(case.schema)
        assert '"enum"' in text and text.count('"type": "object"') >= 2, case.name


def test_the_engine_enforces_every_keyword_of_the_schemas():
    from engine.structured.schema_check import unenforced_keyword

    assert [unenforced_keyword(case.schema) for case in W.CASES] == [None] * len(W.CASES)


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


# ----------------------------------------------------------------------- bench/structured/run.py

SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "string", "enum": ["x", "y"]}},
    "required": ["a", "b"],
    "additionalProperties": False,
}


def test_check_output_parses_validates_and_leaves_truncated_outputs_unchecked():
    assert R.check_output('{"a": 1, "b": "x"}', SCHEMA, "stop")["is_valid"] is True
    wrong = R.check_output('{"a": 1, "b": "z"}', SCHEMA, "stop")
    assert wrong["is_json"] is True and wrong["is_valid"] is False and "'z'" in wrong["error"]
    broken = R.check_output('{"a": 1, "b"', SCHEMA, "stop")
    assert broken["is_json"] is False and broken["is_valid"] is False
    cut = R.check_output('{"a": 1, "b"', SCHEMA, "length")
    assert cut == {"is_truncated": True, "is_json": None, "is_valid": None, "error": None}


def test_first_divergence():
    assert R.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert R.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert R.first_divergence([1, 2], [1, 2, 3]) == 2
    assert R.first_divergence([], [4]) == 0


def _measurement(num_tokens, t_one, t_all, valid=True, truncated=False, divergence=None):
    return {
        "token_ids": list(range(num_tokens)),
        "t_one": t_one,
        "t_all": t_all,
        "is_truncated": truncated,
        "is_valid": None if truncated else valid,
        "first_divergence": divergence,
        "mean_acceptance_length": 3.0,
    }


def _results(overrides=None):
    # case a: 11 tokens; free 10 decode tokens in 1.0 s, grammar in 1.25 s, spec in 0.5 s
    # case b: 21 tokens; free in 2.0 s, grammar in 2.5 s, spec in 0.5 s
    results = {
        ("a", "free"): _measurement(11, 0.5, 1.5),
        ("a", "grammar"): _measurement(11, 0.5, 1.75),
        ("a", "grammar_spec"): _measurement(11, 0.5, 1.0),
        ("b", "free"): _measurement(21, 0.5, 2.5),
        ("b", "grammar"): _measurement(21, 0.5, 3.0),
        ("b", "grammar_spec"): _measurement(21, 0.5, 1.0),
    }
    results.update(overrides or {})
    return results


def test_summarize_pools_tokens_and_seconds_and_compares_per_token():
    summary = R.summarize(_results(), ["a", "b"])
    modes = summary["modes"]
    assert modes["grammar"]["num_decode_tokens"] == 30
    assert modes["grammar"]["tokens_per_s"] == pytest.approx(30 / 3.75)
    assert modes["grammar_spec"]["tokens_per_s"] == pytest.approx(30 / 1.0)
    assert summary["spec_speedup"] == pytest.approx(3.75)
    assert summary["spec_speedup_per_case"] == pytest.approx({"a": 2.5, "b": 5.0})
    # free 100 ms/token, grammar 125 ms/token
    assert summary["grammar_ms_per_token"] == pytest.approx(25.0)
    assert summary["grammar_overhead"] == pytest.approx(0.25)
    assert summary["is_lossless"] and summary["all_grammar_outputs_valid"]
    assert (summary["num_grammar_outputs"], summary["num_valid"], summary["num_truncated"]) == (
        4,
        4,
        0,
    )


def test_summarize_reports_a_divergence_an_invalid_output_and_truncation():
    results = _results(
        {
            ("a", "grammar_spec"): _measurement(11, 0.5, 1.0, divergence=4),
            ("b", "grammar"): _measurement(21, 0.5, 3.0, valid=False),
            ("b", "grammar_spec"): _measurement(21, 0.5, 1.0, truncated=True),
        }
    )
    summary = R.summarize(results, ["a", "b"])
    assert not summary["is_lossless"]
    assert not summary["all_grammar_outputs_valid"]
    assert (summary["num_valid"], summary["num_truncated"]) == (2, 1)
    # nothing to time: a 1-token output
    one = R.summarize(_results({("a", "free"): _measurement(1, 0.5, 0.5)}), ["a"])
    assert one["modes"]["free"]["tokens_per_s"] is None and one["grammar_ms_per_token"] is None


def test_report_table():
    results = _results()
    settings = {
        "model": "m",
        "dtype": "auto",
        "spec_mode": "always",
        "method": "ngram",
        "k": 8,
        "cases": ["a", "b"],
    }
    summary = R.summarize(results, ["a", "b"])
    document = {"settings": settings, "summary": summary, "runs": R.run_rows(results)}
    assert all("token_ids" not in row for row in document["runs"])
    assert json.loads(json.dumps(document)) == document  # what the bench writes
    lines = R.report(document).splitlines()
    assert lines[2].split() == ["a", "11", "10.00", "8.00", "20.00", "2.50x", "3.00", "yes", "yes"]
    assert lines[4].split() == ["all", "32", "10.00", "8.00", "30.00", "3.75x"]
    assert "+25.00 ms/token over free (+25.0%" in lines[5]
    assert lines[6].startswith("grammar_spec = grammar token for token: yes; valid JSON: 4 of 4")
