"""engine/structured and the verifier's grammar masks, on a hand-built 37-token JSON-pieces
tokenizer (tests/tiny_tokenizers.py) padded to a 40-id model vocabulary.

- StructuredOutput rejects what it cannot hold (bad JSON, a non-object, a json_object spec).
- The compiler: schemas xgrammar rejects are InvalidRequestErrors naming the feature and the
  given param; the cache returns one object per constraint, evicts the least recently used, and
  serves threads compiling at once.
- GrammarState: the mask is exactly what accept() takes, minus the tokens no output may hold
  (raw control bytes, special tokens the detokenizer skips); num_allowed and rollback leave the
  state as it was; forced_text is the text only one way continues with.
- verifier.grammar_masks: row j is the mask after j drafts, rows past a forbidden draft stay
  all-allowed, and the states are back where they were.
"""

from __future__ import annotations

import json
import threading

import pytest
import torch

from engine.core.request import Request
from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from engine.structured import StructuredOutput
from engine.structured.compiler import GrammarCompiler
from engine.structured.masks import TokenMasks, new_masks, unpack_masks
from engine.structured.state import GrammarState
from engine.verification.verifier import grammar_masks
from tests.tiny_tokenizers import JSON_CHARS, JSON_MERGES, json_pieces

# The 32 JSON pieces, raw control characters (tab, 0x01, 0x1f; a newline, which tool-call tags
# need) and a piece with a tab inside it; three ids past the tokenizer pad the model vocabulary.
TOKENIZER = json_pieces([*JSON_CHARS, "\t", "\x01", "\x1f", "\n"], [*JSON_MERGES, ("a", "\t")])
NUM_TOKENS = len(TOKENIZER)
VOCAB = NUM_TOKENS + 3
EOS = 2
CONTROL_PIECES = ["\t", "\x01", "\x1f", "a\t"]
SPECIAL_PIECES = ["<unk>", "<s>"]  # specials besides the end: the detokenizer drops them
ENUM_SCHEMA = {
    "type": "object",
    "properties": {"k": {"enum": ["a", "ab", "b", "ba", "bb"]}},
    "required": ["k"],
    "additionalProperties": False,
}
ENUM = StructuredOutput.json_schema(ENUM_SCHEMA)
DOCUMENT = '{"k": "ab"}'


def _ids(*pieces: str) -> list[int]:
    return [TOKENIZER.convert_tokens_to_ids(p) for p in pieces]


def _tokens(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


def _compiler(cache_size: int = 8) -> GrammarCompiler:
    return GrammarCompiler(TOKENIZER, VOCAB, [EOS], cache_size=cache_size)


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return _compiler()


def _state(compiler: GrammarCompiler, structured: StructuredOutput = ENUM) -> GrammarState:
    return GrammarState(compiler.compile(structured), VOCAB)


def _mask(state: GrammarState) -> torch.Tensor:
    """[VOCAB] bool: the tokens the state allows next."""
    packed = new_masks(1, VOCAB)
    state.fill_mask(packed, 0)
    return unpack_masks(packed, VOCAB)[0]


def _accepted(state: GrammarState) -> torch.Tensor:
    """[VOCAB] bool: the tokens accept() takes from here, each rolled back."""
    taken = torch.zeros(VOCAB, dtype=torch.bool)
    for token_id in range(VOCAB):
        if state.accept(token_id):
            taken[token_id] = True
            state.rollback(1)
    return taken


# ------------------------------------------------------------------------------ StructuredOutput


@pytest.mark.parametrize(
    ("kind", "spec", "match"),
    [
        ("json_schema", '{"type": "object",', "not valid JSON"),
        ("structural_tag", "", "not valid JSON"),
        ("json_schema", "[1, 2]", "must be a JSON object"),
        ("json_schema", '"string"', "must be a JSON object"),
        ("structural_tag", "true", "must be a JSON object"),
        ("json_object", '{"type": "object"}', "takes no spec"),
        ("regex", "a+", "not supported"),
    ],
)
def test_structured_output_rejects_what_it_cannot_hold(kind, spec, match) -> None:
    with pytest.raises(ValueError, match=match):
        StructuredOutput(kind, spec)


def test_structured_output_keeps_the_schema_and_compares_by_value() -> None:
    assert StructuredOutput("json_schema", "true").spec == "true"  # the schema that allows all
    schema = {"z": 1, "a": {"enum": ["é"]}}
    made = StructuredOutput.json_schema(schema)
    assert list(json.loads(made.spec)) == ["z", "a"] and "é" in made.spec  # order, no escapes
    assert made == StructuredOutput.json_schema(json.dumps(schema, ensure_ascii=False))
    assert hash(made) == hash(StructuredOutput.json_schema(dict(schema)))
    assert StructuredOutput.json_object() == StructuredOutput("json_object")


# ------------------------------------------------------------------------------------ compiler


@pytest.mark.parametrize(
    ("schema", "feature"),
    [
        ({"type": "string", "pattern": "(?<=a)b"}, "[Ll]ookbehind"),  # unsupported
        ({"type": "nonsense"}, "nonsense"),  # invalid
        ({"type": "integer", "minimum": 5, "maximum": 2}, "minimum"),  # unsatisfiable
    ],
)
def test_a_schema_xgrammar_rejects_is_an_invalid_request(compiler, schema, feature) -> None:
    num_cached = compiler.num_cached
    with pytest.raises(InvalidRequestError, match=feature) as e:
        compiler.compile(StructuredOutput.json_schema(schema), param="tools")
    assert e.value.param == "tools"
    message = str(e.value)
    assert message.startswith("the json schema cannot be used: ")
    assert ".cc:" not in message and "\n" not in message  # xgrammar's location prefix is gone
    assert compiler.num_cached == num_cached  # a failure is not cached


def test_the_cache_returns_one_object_per_constraint_and_evicts_the_oldest() -> None:
    compiler = _compiler(cache_size=2)
    schemas = [StructuredOutput.json_schema({"enum": [value]}) for value in ("a", "b", "ab")]
    first = compiler.compile(schemas[0])
    assert compiler.compile(StructuredOutput.json_schema({"enum": ["a"]})) is first
    second = compiler.compile(schemas[1])
    assert compiler.compile(schemas[0]) is first  # schemas[0] is now the most recently used
    compiler.compile(schemas[2])  # evicts schemas[1], the least recently used
    assert compiler.num_cached == 2
    assert compiler.compile(schemas[0]) is first
    recompiled = compiler.compile(schemas[1])
    assert recompiled is not second  # compiled anew, and it is the same grammar
    state = GrammarState(recompiled, VOCAB)
    assert state.num_allowed(_tokens('"b"') + [EOS]) == len(_tokens('"b"')) + 1
    assert state.is_terminated is False and compiler.num_cached == 2


def test_threads_compiling_at_once_all_get_their_grammar() -> None:
    """Eight threads compile three new schemas (each schema by several threads) at once; each
    result takes its own document only."""
    compiler = _compiler()
    values = ["a", "ab", "bb"]
    documents = [_tokens(f'"{value}"') + [EOS] for value in values]
    barrier = threading.Barrier(8)
    results: dict[int, object] = {}
    errors: list[BaseException] = []

    def work(thread: int) -> None:
        try:
            barrier.wait()
            which = thread % len(values)
            compiled = compiler.compile(StructuredOutput.json_schema({"enum": [values[which]]}))
            for other, document in enumerate(documents):
                state = GrammarState(compiled, VOCAB)
                is_taken = state.num_allowed(document) == len(document)
                assert is_taken == (other == which), (thread, values[other])
            results[thread] = compiled
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert len(results) == 8 and compiler.num_cached == len(values)
    for value in values:  # one grammar kept per schema
        structured = StructuredOutput.json_schema({"enum": [value]})
        assert compiler.compile(structured) is compiler.compile(structured)


# ------------------------------------------------------------------------------- grammar state


def _walk(compiler: GrammarCompiler) -> list[tuple[StructuredOutput, list[int]]]:
    """Constraints with the prefixes of a document each, up to the whole document before its
    end token (a terminated state has no mask): the states the mask tests visit."""
    enum_doc = _tokens(DOCUMENT) + [EOS]
    obj_doc = _tokens('{"k": [1, "ab", null]}') + [EOS]
    string_doc = _tokens('"ab1"') + [EOS]
    walks = [
        (ENUM, enum_doc),
        (StructuredOutput.json_object(), obj_doc),
        (StructuredOutput.json_schema({"type": "string", "maxLength": 4}), string_doc),
    ]
    return [(s, doc[:n]) for s, doc in walks for n in range(len(doc))]


def test_the_mask_is_what_accept_takes_less_the_banned_tokens(compiler) -> None:
    banned = torch.zeros(VOCAB, dtype=torch.bool)
    banned[_ids(*CONTROL_PIECES, *SPECIAL_PIECES)] = True
    num_multi = 0
    for structured, prefix in _walk(compiler):
        state = _state(compiler, structured)
        assert all(state.accept(t) for t in prefix)
        mask, taken = _mask(state), _accepted(state)
        assert torch.equal(mask, taken & ~banned), (structured.kind, prefix)
        assert not mask[NUM_TOKENS:].any()  # the padding past the tokenizer
        assert torch.equal(_mask(state), mask)  # the accept/rollback probes changed nothing
        num_multi += int(mask.sum()) > 1
    assert num_multi >= 10  # most states allow several tokens


def test_control_bytes_and_skipped_specials_are_never_allowed(compiler) -> None:
    """Inside a length-bounded string xgrammar itself takes raw control characters and special
    tokens (as their literal text, which the detokenizer would skip): the static ban removes
    them, and keeps the newline and the end."""
    bounded = StructuredOutput.json_schema({"type": "string", "maxLength": 6})
    state = _state(compiler, bounded)
    assert state.accept(_ids('"')[0])
    taken = _accepted(state)
    assert taken[_ids(*CONTROL_PIECES)].all() and taken[_ids(*SPECIAL_PIECES)].all()
    for structured, prefix in _walk(compiler):
        state = _state(compiler, structured)
        assert all(state.accept(t) for t in prefix)
        mask = _mask(state)
        assert not mask[_ids(*CONTROL_PIECES, *SPECIAL_PIECES)].any(), prefix
    compiled = compiler.compile(ENUM)
    allowed = unpack_masks(compiled.allowed.unsqueeze(0), VOCAB)[0]
    assert allowed[_ids("\n", "a", '{"k": "')].all() and allowed[EOS]


def test_num_allowed_and_rollback_leave_the_state_unchanged(compiler) -> None:
    document = _tokens(DOCUMENT) + [EOS]  # '{"k": "', 'ab', '"}', eos
    state = _state(compiler, ENUM)
    start = _mask(state)
    assert state.num_allowed(document) == len(document)
    assert state.num_allowed([*document[:2], _ids("a")[0], *document[2:]]) == 2
    assert state.num_allowed(_ids("{", '"', "k", '"')) == 4  # another tokenization
    assert state.num_allowed(_ids("}")) == 0
    assert torch.equal(_mask(state), start) and not state.is_terminated
    assert state.accept(document[0]) and state.accept(document[1])
    middle = _mask(state)
    state.rollback(0)
    assert torch.equal(_mask(state), middle)
    assert all(state.accept(t) for t in document[2:]) and state.is_terminated
    assert state.num_allowed(document) == 0 and state.forced_text() == ""
    state.rollback(2)
    assert torch.equal(_mask(state), middle) and not state.is_terminated
    state.rollback(2)
    assert torch.equal(_mask(state), start)


def test_forced_text_is_the_text_only_one_way_continues_with(compiler) -> None:
    two_keys = StructuredOutput.json_schema(
        {
            "type": "object",
            "properties": {"name": {"type": "string"}, "k": {"enum": ["alpha", "beta"]}},
            "required": ["name", "k"],
            "additionalProperties": False,
        }
    )
    assert _state(compiler, two_keys).forced_text() == '{"name": "'
    state = _state(compiler, ENUM)
    assert state.forced_text() == '{"k": "'
    assert state.accept(_ids("{")[0]) and state.forced_text() == '"k": "'
    assert state.accept(_ids('"')[0]) and state.forced_text() == 'k": "'
    assert all(state.accept(t) for t in _ids('k"', ': "'))
    assert state.forced_text() == ""  # five values to choose from
    assert state.accept(_ids("ab")[0]) and state.forced_text() == '"}'


# ----------------------------------------------------------------------- verifier grammar masks


def _request(compiler: GrammarCompiler, prefix: list[int], structured: StructuredOutput = ENUM):
    request = Request("r", [1, 3], SamplingParams(), max_tokens=16)
    request.grammar = _state(compiler, structured)
    assert all(request.grammar.accept(t) for t in prefix)
    return request


def _after(compiler: GrammarCompiler, tokens: list[int]) -> torch.Tensor:
    state = _state(compiler)
    assert all(state.accept(t) for t in tokens)
    return _mask(state)


def test_verify_row_j_is_masked_with_the_state_after_j_drafts(compiler) -> None:
    document = _tokens(DOCUMENT) + [EOS]  # '{"k": "', 'ab', '"}', eos
    plain = Request("p", [1, 3], SamplingParams(), max_tokens=16)
    at_start = _request(compiler, [])
    inside = _request(compiler, document[:1])
    drafts = [[], document[:3], document[1:4]]
    starts = [0, 1, 5]
    before = [_mask(at_start.grammar), _mask(inside.grammar)]
    masks = grammar_masks([plain, at_start, inside], drafts, starts, VOCAB)
    assert isinstance(masks, TokenMasks)
    assert masks.row_ids == [1, 2, 3, 4, 5, 6, 7, 8]  # the plain request's row 0 is not masked
    rows = unpack_masks(masks.packed, VOCAB)
    for j in range(4):
        assert torch.equal(rows[j], _after(compiler, document[:j])), j
    for j in range(3):
        assert torch.equal(rows[4 + j], _after(compiler, document[: 1 + j])), j
    assert rows[3].sum() == 1 and rows[3][EOS]  # the document is complete: only the end
    assert rows[7].all()  # past the end (the last draft was the end token): never read
    assert torch.equal(_mask(at_start.grammar), before[0])  # rolled back
    assert torch.equal(_mask(inside.grammar), before[1])
    assert grammar_masks([plain], [[5, 6]], [0], VOCAB) is None


def test_rows_past_a_forbidden_draft_or_the_end_stay_all_allowed(compiler) -> None:
    document = _tokens(DOCUMENT) + [EOS]
    request = _request(compiler, [])
    # The second draft is forbidden: row 1 is masked (it rejects it), rows 2 and 3 never read.
    drafts = [[document[0], _ids("}")[0], document[1]]]
    masks = grammar_masks([request], drafts, [0], VOCAB)
    rows = unpack_masks(masks.packed, VOCAB)
    assert torch.equal(rows[0], _after(compiler, []))
    assert torch.equal(rows[1], _after(compiler, document[:1]))
    assert not rows[1][_ids("}")[0]]
    assert rows[2:].all() and (masks.packed[2:] == -1).all()
    assert torch.equal(_mask(request.grammar), _after(compiler, []))
    # Drafts past the end (the end token, then anything): the row after the end is unmasked.
    ended = _request(compiler, document[:3])
    masks = grammar_masks([ended], [[EOS, 5]], [0], VOCAB)
    rows = unpack_masks(masks.packed, VOCAB)
    assert rows[0].sum() == 1 and rows[0][EOS] and rows[1:].all()
    assert not ended.grammar.is_terminated and ended.grammar.accept(EOS)
