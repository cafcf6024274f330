"""Structured outputs end to end on the offline engine: a tiny random-weight model over SmolLM2's
vocabulary, where only the grammar can make the output valid.

- Greedy output under a JSON schema is token-identical with speculation off and with every
  proposer (the grammar's forced text, n-gram, a draft model, predicted outputs).
- Sampled output (temperature 1, n > 1) is valid against its schema with every proposer.
- Penalties, logprobs, stop strings and min_tokens keep working inside a grammar; a schema the
  grammar library cannot use is an error naming it; no KV block is left behind.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from engine import LLM, SamplingParams
from engine.errors import InvalidRequestError
from engine.structured import StructuredOutput
from tests.e2e.conftest import build_chat_model

SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "kind": {"enum": ["alpha", "beta", "gamma"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
            "ok": {"type": "boolean"},
        },
        "required": ["name", "kind", "tags", "ok"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "points": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"x": {"enum": [0, 1, 2]}, "label": {"enum": ["a", "bb"]}},
                    "required": ["x", "label"],
                    "additionalProperties": False,
                },
                "minItems": 1,
                "maxItems": 3,
            },
            "done": {"type": "null"},
        },
        "required": ["points", "done"],
        "additionalProperties": False,
    },
]
PROMPTS = ["Give me a record.", "List some points as JSON, please."]
MAX_TOKENS = 200
NUM_DRAFTS = 4


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    return build_chat_model(tmp_path_factory.mktemp("structured-chat"), seed=5)


@pytest.fixture(scope="module")
def draft_model(tmp_path_factory) -> Path:
    return build_chat_model(tmp_path_factory.mktemp("structured-draft"), seed=6)


def _llm(model: Path, speculative: dict[str, Any] | None, draft: Path | None = None) -> LLM:
    if speculative is not None and speculative.get("method") == "draft_model":
        speculative = {**speculative, "model": str(draft)}
    return LLM(
        str(model),
        dtype="float32",
        block_size=16,
        num_kv_blocks=256,
        max_model_len=512,
        speculative_config=speculative,
    )


# Speculation off, the grammar alone (no speculative config: forced text still drafts), and each
# configured proposer after it.
CONFIGS: dict[str, dict[str, Any] | None] = {
    "off": {"method": "ngram", "mode": "off"},
    "grammar": None,
    "ngram": {
        "method": "ngram",
        "mode": "always",
        "num_speculative_tokens": NUM_DRAFTS,
        "prompt_lookup_min": 1,
    },
    "draft_model": {
        "method": "draft_model",
        "mode": "always",
        "num_speculative_tokens": NUM_DRAFTS,
    },
}


def _generate(
    llm: LLM, params: list[SamplingParams], predictions: list[str] | None = None
) -> list[list[Any]]:
    """Every prompt under its params (predictions: OpenAI Predicted Outputs, one per prompt);
    the completions of each, in order."""
    engine = llm.engine
    for i, (prompt, p) in enumerate(zip(PROMPTS, params, strict=True)):
        ids = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        engine.add_request(str(i), ids, p, prediction=predictions[i] if predictions else None)
    done: dict[str, list[Any]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                slot = done.setdefault(out.request_id, [[] for _ in out.outputs])[c.index]
                slot.append(c)
    engine.block_manager.check_integrity()
    assert engine.block_manager.num_used_blocks == 0  # nothing left behind
    return [_merge(done[str(i)]) for i in range(len(PROMPTS))]


def _merge(pieces: list[list[Any]]) -> list[Any]:
    """Per completion: (token ids, text, finish_reason, logprobs or None) accumulated over the
    step deltas."""
    merged = []
    for deltas in pieces:
        ids = [t for d in deltas for t in d.token_ids]
        logprobs = None if deltas[0].logprobs is None else [e for d in deltas for e in d.logprobs]
        merged.append((ids, "".join(d.text for d in deltas), deltas[-1].finish_reason, logprobs))
    return merged


def _params(schema: dict[str, Any], **kw: Any) -> SamplingParams:
    return SamplingParams(
        max_tokens=MAX_TOKENS, structured=StructuredOutput.json_schema(schema), **kw
    )


def test_greedy_output_is_identical_with_every_proposer(chat_model, draft_model) -> None:
    params = [_params(s, temperature=0.0) for s in SCHEMAS]
    outputs, drafted = {}, {}
    for name, config in CONFIGS.items():
        llm = _llm(chat_model, config, draft_model)
        outputs[name] = _generate(llm, params)
        drafted[name] = llm.engine.spec_stats.num_draft_tokens
    # Predicted outputs: the reference output as the prediction, one character changed.
    predictions = [json.dumps(json.loads(o[0][1]))[:-3] + " }" for o in outputs["off"]]
    no_lookup = {
        "method": "ngram",
        "mode": "always",
        "prompt_lookup_min": 8,
        "prompt_lookup_max": 8,
    }
    llm = _llm(chat_model, no_lookup)
    outputs["prediction"] = _generate(llm, params, predictions)
    drafted["prediction"] = llm.engine.spec_stats.num_draft_tokens
    for ((_, text, reason, _),), schema in zip(outputs["off"], SCHEMAS, strict=True):
        assert reason == "stop"
        jsonschema.validate(json.loads(text), schema)
    for name, got in outputs.items():
        assert [o[0][0] for o in got] == [o[0][0] for o in outputs["off"]], name
    assert drafted["off"] == 0
    assert all(drafted[name] > 0 for name in drafted if name != "off"), drafted


@pytest.mark.parametrize("name", [n for n in CONFIGS if n != "off"])
def test_sampled_output_is_schema_valid(chat_model, draft_model, name: str) -> None:
    """And every draft is within the grammar when it is verified: lookups are cut, the draft
    model samples under the grammar's mask, forced text is allowed by construction."""
    llm = _llm(chat_model, CONFIGS[name], draft_model)
    speculator = llm.engine.speculator
    propose, num_checked = speculator.propose, [0]

    def checked_propose(schedule):
        drafts = propose(schedule)
        for s in schedule.scheduled:
            draft = drafts.get(s.request.request_id)
            if draft is not None:
                assert s.request.grammar.num_allowed(draft.token_ids) == len(draft.token_ids)
                num_checked[0] += 1
        return drafts

    speculator.propose = checked_propose
    params = [_params(s, temperature=1.0, n=4, seed=11 + i) for i, s in enumerate(SCHEMAS)]
    outputs = _generate(llm, params)
    for completions, schema in zip(outputs, SCHEMAS, strict=True):
        assert len(completions) == 4
        for _, text, reason, _ in completions:
            assert reason == "stop", text
            jsonschema.validate(json.loads(text), schema)
    assert llm.engine.spec_stats.num_accepted_tokens > 0 and num_checked[0] > 0


def test_json_object_and_options_inside_a_grammar(chat_model) -> None:
    llm = _llm(chat_model, CONFIGS["ngram"])
    json_object = StructuredOutput.json_object()
    params = [
        SamplingParams(
            temperature=1.0, seed=3, max_tokens=MAX_TOKENS, structured=json_object, logprobs=2
        ),
        _params(SCHEMAS[0], temperature=0.0, repetition_penalty=1.3, min_tokens=150),
    ]
    (first,), (second,) = _generate(llm, params)
    ids, text, reason, logprobs = first
    # Logprobs of the masked distribution: one per token, the token's own and finite (it was
    # allowed), never below the tokens ranked under it.
    assert [e.token_id for e in logprobs] == ids
    for e in logprobs:
        assert e.logprob > float("-inf") and len(e.top_token_ids) == 2
        assert e.logprob <= e.top_logprobs[0] and e.top_logprobs[0] >= e.top_logprobs[1]
    if reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # an object may run long at temperature 1: what was written is still a prefix
        assert reason == "length" and text.startswith("{")
    # min_tokens beyond the document: the grammar's end wins, the document is whole.
    ids, text, reason, _ = second
    assert reason == "stop" and len(ids) < 150
    jsonschema.validate(json.loads(text), SCHEMAS[0])


def test_stop_string_and_logprobs_inside_a_grammar(chat_model) -> None:
    llm = _llm(chat_model, CONFIGS["ngram"])
    params = _params(SCHEMAS[0], temperature=0.0, logprobs=1)
    (full,), _ = _generate(llm, [params, _params(SCHEMAS[1], temperature=0.0)])
    ids, text, _, logprobs = full
    # Greedy under the grammar: every token is the top of its masked distribution.
    assert [e.token_id for e in logprobs] == ids
    assert all(
        e.top_token_ids[0] == e.token_id and e.logprob == e.top_logprobs[0] for e in logprobs
    )
    cut = text[: text.index('"kind"')]
    stop = '"kind"'
    (stopped,), _ = _generate(
        llm, [_params(SCHEMAS[0], temperature=0.0, stop=[stop]), _params(SCHEMAS[1])]
    )
    assert stopped[2] == "stop" and stopped[1] == cut


def test_a_schema_the_grammar_cannot_use_names_it(chat_model) -> None:
    llm = _llm(chat_model, None)
    bad = StructuredOutput.json_schema({"type": "string", "pattern": "(?<=a)b"})
    with pytest.raises(InvalidRequestError, match="[Ll]ookbehind") as e:
        llm.engine.add_request("x", "hi", SamplingParams(structured=bad))
    assert e.value.param == "response_format"
    assert not llm.engine.has_unfinished_requests()


def test_special_tokens_are_not_taken_as_their_text(chat_model) -> None:
    """xgrammar takes a special token inside a JSON string as its literal text, but the
    detokenizer skips special tokens: a model keen on <|endoftext|> (id 0, not an end token)
    would get '""' past a grammar that counted 13 characters in it. Only the end token may be
    special."""
    llm = _llm(chat_model, None)
    tokenizer = llm.get_tokenizer()
    quote = tokenizer.convert_tokens_to_ids('"')
    schema = {"type": "string", "minLength": 13, "maxLength": 13}
    params = _params(schema, temperature=0.0, logit_bias={quote: 50.0, 0: 100.0})
    (completion,), _ = _generate(llm, [params, _params(SCHEMAS[1], temperature=0.0)])
    ids, text, reason, _ = completion
    assert reason == "stop"
    jsonschema.validate(json.loads(text), schema)
    assert not set(ids[:-1]) & set(tokenizer.all_special_ids), ids


def test_offline_chat_renders_tools_like_the_server(chat_model) -> None:
    """`LLM.chat(..., tools=...)` puts the functions into the prompt through the model's template
    (here the tests' ChatML template with tools), the same ids the server's prompt tokenizer
    makes for them."""
    from engine.text.tokenizer import apply_chat_template

    llm = _llm(chat_model, None)
    template = Path(__file__).resolve().parents[1] / "templates" / "chatml_tools.jinja"
    llm.get_tokenizer().chat_template = template.read_text()
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The weather in a city.",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    conversation = [{"role": "user", "content": "Weather in Paris?"}]
    params = SamplingParams(temperature=0.0, max_tokens=4)
    (with_tools,) = llm.chat(conversation, params, tools=tools)
    (without,) = llm.chat(conversation, params)
    tokenizer = llm.get_tokenizer()
    expected = apply_chat_template(tokenizer, conversation, tools=tools)
    assert with_tools.prompt_token_ids == expected
    assert "get_weather" in tokenizer.decode(expected)
    assert without.prompt_token_ids == apply_chat_template(tokenizer, conversation)
    assert len(without.prompt_token_ids) < len(expected)
