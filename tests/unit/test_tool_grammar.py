"""The hermes parser's structural tag, compiled by the engine's grammar compiler: it admits exactly
calls of the offered functions with schema-valid arguments (one call without parallel calls, and
one call of a named function whatever parallel calls say), after the last allowed call only the
end, and whatever it admits, the parser reads back as calls. On a byte-level BPE trained in the
test."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch

from engine.structured.compiler import GrammarCompiler
from engine.structured.masks import new_masks, unpack_masks
from engine.structured.state import GrammarState
from server.tool_parsers import get_parser
from server.tool_parsers.base import FunctionSpec
from tests.tiny_tokenizers import CHATML_SPECIALS, SAMPLE_CORPUS, byte_level_bpe

HERMES = get_parser("hermes")
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
FUNCTIONS = [
    FunctionSpec("get_weather", WEATHER_SCHEMA),
    FunctionSpec("now", {"type": "object", "properties": {}, "additionalProperties": False}),
]


def call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


PARIS = call("get_weather", '{"city": "Paris", "days": 3}')
NOW = call("now", "{}")


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    tokenizer = byte_level_bpe(SAMPLE_CORPUS, 330, CHATML_SPECIALS)
    return GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def _state(compiler, tool_choice: str, parallel: bool = True) -> GrammarState:
    structured = HERMES.structural_tag(FUNCTIONS, tool_choice, parallel)
    assert structured is not None and structured.kind == "structural_tag"
    return GrammarState(compiler.compile(structured, "tools"), compiler.vocab_size)


def _admits(compiler, state: GrammarState, text: str, then_stop: bool = True) -> bool:
    tokenizer = compiler._tokenizer
    for token_id in tokenizer.encode(text, add_special_tokens=False):
        if not state.accept(token_id):
            return False
    return not then_stop or state.accept(compiler.stop_token_ids[0])


@pytest.mark.parametrize(
    ("tool_choice", "parallel", "text", "admitted"),
    [
        ("required", True, PARIS, True),
        ("required", True, NOW, True),
        ("required", True, f"{PARIS}\n{NOW}", True),
        ("required", False, f"{PARIS}\n{NOW}", False),
        ("required", True, "Sure. " + PARIS, False),  # no content
        ("required", True, "", False),  # at least one call
        ("required", True, call("get_weather", '{"city": "Oslo", "days": 3}'), False),
        ("required", True, call("get_weather", '{"city": "Paris"}'), False),
        ("required", True, call("unknown", "{}"), False),
        ("now", True, NOW, True),
        ("now", True, PARIS, False),
        ("now", True, f"{NOW}\n{NOW}", False),  # a named function: one call, parallel or not
        ("now", False, f"{NOW}\n{NOW}", False),
    ],
)
def test_grammar_admits_only_calls(compiler, tool_choice, parallel, text, admitted):
    assert _admits(compiler, _state(compiler, tool_choice, parallel), text) is admitted


def _allowed(compiler, state: GrammarState) -> set[int]:
    masks = new_masks(1, compiler.vocab_size)
    state.fill_mask(masks, 0)
    return set(torch.nonzero(unpack_masks(masks, compiler.vocab_size)[0]).flatten().tolist())


@pytest.mark.parametrize(
    ("tool_choice", "parallel", "num_calls"),
    [("now", True, 1), ("now", False, 1), ("required", False, 1), ("required", True, 3)],
)
def test_after_the_last_allowed_call_only_the_end_may_follow(
    compiler, tool_choice, parallel, num_calls
):
    """After each call the grammar allows the end; after the last one allowed, nothing else. Under
    "one or more" another call may follow any of them."""
    eos = compiler.stop_token_ids[0]
    state = _state(compiler, tool_choice, parallel)
    for i in range(num_calls):
        assert _admits(compiler, state, ("\n" if i else "") + NOW, then_stop=False)
        allowed = _allowed(compiler, state)
        assert eos in allowed
        if num_calls == 1:
            assert allowed == {eos}
        else:
            assert len(allowed) > 1  # the separator of the next call
    assert state.accept(eos) and state.is_terminated


def test_auto_and_none_have_no_grammar():
    assert HERMES.structural_tag(FUNCTIONS, "auto", True) is None
    assert HERMES.structural_tag(FUNCTIONS, "none", True) is None


@pytest.mark.parametrize("seed", range(4))
def test_random_outputs_of_the_grammar_are_valid_calls(compiler, seed):
    # A random walk over the allowed tokens stands for a random model under enforcement.
    tokenizer = compiler._tokenizer
    rng = random.Random(seed)
    state = _state(compiler, "required", parallel=seed % 2 == 0)
    masks = new_masks(1, compiler.vocab_size)
    token_ids = []
    for _ in range(400):
        state.fill_mask(masks, 0)
        allowed = torch.nonzero(unpack_masks(masks, compiler.vocab_size)[0]).flatten().tolist()
        token_id = rng.choice(allowed)
        if token_id in compiler.stop_token_ids:
            break
        assert state.accept(token_id)
        token_ids.append(token_id)
    else:
        pytest.fail("the walk did not end")
    message = HERMES.parse(tokenizer.decode(token_ids))
    assert message.content is None and message.calls
    for parsed in message.calls:
        schema = next(f.parameters for f in FUNCTIONS if f.name == parsed.name)
        jsonschema.validate(json.loads(parsed.arguments), schema)
