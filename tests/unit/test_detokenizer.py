"""Incremental detokenization and stop strings on tokenizers built here (chat templates and eos
ids: test_chat_template.py).

Three tiny tokenizers are trained in the test (no downloads): a byte-level BPE (GPT-2 / Qwen
style, with single-byte tokens that split multi-byte characters), a Metaspace BPE
(SentencePiece-style "▁" tokens), and a Llama-style BPE with byte-fallback tokens `<0xE4>`.
"""

from __future__ import annotations

import logging
import random

import pytest
from transformers import PreTrainedTokenizerFast

from engine.sampling_params import SamplingParams
from engine.text.detokenizer import DetokenizerUpdate, IncrementalDetokenizer
from tests.tiny_tokenizers import (
    CHATML_SPECIALS,
    SAMPLE_CORPUS,
    byte_level_bpe,
    llama_byte_fallback,
    metaspace_bpe,
)

CORPUS = SAMPLE_CORPUS
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Un café naïve, déjà vu — résumé!",
    "你好 中文 测试 🙂 smile 🙂🙂",
    "  leading spaces, tabs\tand\nnewlines  ",
    "x = [i for i in range(10)]  # 🙂 é",
]
logger = logging.getLogger(__name__)
SPECIAL_TOKENS = CHATML_SPECIALS


def _byte_level() -> PreTrainedTokenizerFast:
    return byte_level_bpe(CORPUS, 330, SPECIAL_TOKENS)


def _metaspace() -> PreTrainedTokenizerFast:
    return metaspace_bpe(CORPUS, 200)


def _llama_byte_fallback() -> PreTrainedTokenizerFast:
    return llama_byte_fallback(CORPUS, 150)


@pytest.fixture(scope="module")
def byte_level() -> PreTrainedTokenizerFast:
    return _byte_level()


@pytest.fixture(scope="module", params=["byte_level", "metaspace", "llama_byte_fallback"])
def any_tokenizer(request: pytest.FixtureRequest) -> PreTrainedTokenizerFast:
    return {
        "byte_level": _byte_level,
        "metaspace": _metaspace,
        "llama_byte_fallback": _llama_byte_fallback,
    }[request.param]()


def _decode(tokenizer, ids, skip_special_tokens=True) -> str:
    return tokenizer.decode(
        ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
    )


def _run(tokenizer, prompt_ids, output_ids, chunk_sizes, params=None):
    """Feed `output_ids` in chunks; return (detokenizer, updates, flushed text or None)."""
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, params or SamplingParams())
    updates, pos, i = [], 0, 0
    while pos < len(output_ids):
        size = chunk_sizes[i % len(chunk_sizes)]
        update = detok.append(output_ids[pos : pos + size])
        updates.append(update)
        i += 1
        pos += size
        if update.stop_string is not None:
            return detok, updates, None
    return detok, updates, detok.flush()


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("chunk_sizes", [(1,), (3,), (9,), (1, 4, 2, 9)])
def test_concatenation_equals_full_decode_without_prompt(any_tokenizer, chunk_sizes):
    for text in TEXTS:
        output_ids = _encode(any_tokenizer, text)
        detok, updates, flushed = _run(any_tokenizer, [], output_ids, chunk_sizes)
        emitted = "".join(u.text for u in updates) + flushed
        assert emitted == _decode(any_tokenizer, output_ids)
        assert detok.output_text == emitted
        assert sum(u.num_tokens_kept for u in updates) == len(output_ids)
        assert all(u.stop_string is None for u in updates)


@pytest.mark.parametrize("chunk_sizes", [(1,), (2, 9)])
def test_with_prompt_text_continues_the_prompt(any_tokenizer, chunk_sizes):
    prompt_ids = _encode(any_tokenizer, "Tell me a story about the fox:")
    for text in TEXTS:
        output_ids = _encode(any_tokenizer, text)
        _, updates, flushed = _run(any_tokenizer, prompt_ids, output_ids, chunk_sizes)
        emitted = "".join(u.text for u in updates) + flushed
        prompt_text = _decode(any_tokenizer, prompt_ids)
        full_text = _decode(any_tokenizer, prompt_ids + output_ids)
        assert full_text.startswith(prompt_text)
        assert emitted == full_text[len(prompt_text) :]


def test_prompt_context_keeps_leading_space_of_sentencepiece_token():
    tokenizer = _metaspace()
    output_ids = _encode(tokenizer, "the lazy dog")
    assert tokenizer.convert_ids_to_tokens(output_ids[:1])[0].startswith("▁")
    _, with_prompt, flushed = _run(tokenizer, _encode(tokenizer, "Hello"), output_ids, (1,))
    assert "".join(u.text for u in with_prompt) + flushed == " the lazy dog"
    _, without_prompt, flushed = _run(tokenizer, [], output_ids, (1,))
    assert "".join(u.text for u in without_prompt) + flushed == "the lazy dog"


@pytest.mark.parametrize("seed", range(5))
def test_random_token_sequences_byte_level(byte_level, seed):
    rng = random.Random(seed)
    prompt_ids = [rng.randrange(len(byte_level)) for _ in range(rng.randrange(0, 8))]
    output_ids = [rng.randrange(len(byte_level)) for _ in range(200)]
    chunks = tuple(rng.randint(1, 9) for _ in range(7))
    for skip in (True, False):
        params = SamplingParams(skip_special_tokens=skip)
        _, updates, flushed = _run(byte_level, prompt_ids, output_ids, chunks, params)
        emitted = "".join(u.text for u in updates) + flushed
        assert emitted == _decode(byte_level, output_ids, skip_special_tokens=skip)


@pytest.mark.parametrize("seed", range(3))
def test_random_token_sequences_metaspace(seed):
    tokenizer = _metaspace()
    rng = random.Random(seed)
    output_ids = [rng.randrange(len(tokenizer)) for _ in range(150)]
    _, updates, flushed = _run(tokenizer, [], output_ids, (1, 5, 9))
    assert "".join(u.text for u in updates) + flushed == _decode(tokenizer, output_ids)


@pytest.mark.parametrize("make_tokenizer", [_byte_level, _llama_byte_fallback])
def test_never_splits_a_utf8_character(make_tokenizer):
    tokenizer = make_tokenizer()
    text = "中文 测试 🙂🙂 café déjà 你好🙂"
    output_ids = _encode(tokenizer, text)
    # The test only means something if single tokens hold partial characters.
    assert any("\ufffd" in _decode(tokenizer, [t]) for t in output_ids)
    for chunk_sizes in [(1,), (2,), (3, 1)]:
        _, updates, flushed = _run(tokenizer, [], output_ids, chunk_sizes)
        assert all("\ufffd" not in u.text for u in updates)
        assert flushed == ""
        assert "".join(u.text for u in updates) == text


def test_decode_window_stays_bounded(byte_level):
    lengths: list[int] = []

    class Spy:
        def decode(self, ids, **kwargs):
            lengths.append(len(ids))
            return byte_level.decode(ids, **kwargs)

    output_ids = _encode(byte_level, " ".join(TEXTS * 20))
    assert len(output_ids) > 500
    _, updates, flushed = _run(Spy(), _encode(byte_level, "prompt " * 50), output_ids, (1, 7))
    assert "".join(u.text for u in updates) + flushed == _decode(byte_level, output_ids)
    assert max(lengths) <= 12
    assert len(lengths) <= 2 * len(output_ids) + 2


def _reference_stop(tokenizer, output_ids, stops):
    """Brute force: the first token after which a stop string shows up in the decoded text."""
    for j in range(1, len(output_ids) + 1):
        text = _decode(tokenizer, output_ids[:j])
        found = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
        if found:
            _, start, stop = min(found)
            return text[:start], j, stop
    raise AssertionError("no stop string in the text")


def _check_stop(tokenizer, output_ids, stops, chunk_sizes):
    params = SamplingParams(stop=stops)
    detok, updates, flushed = _run(tokenizer, [], output_ids, chunk_sizes, params)
    expected_text, expected_num_tokens, expected_stop = _reference_stop(
        tokenizer, output_ids, stops
    )
    assert flushed is None
    assert updates[-1].stop_string == expected_stop == detok.stop_string
    num_kept = sum(u.num_tokens_kept for u in updates)
    assert num_kept == expected_num_tokens
    assert "".join(u.text for u in updates) == expected_text == detok.output_text
    assert all(not any(s in u.text for s in stops) for u in updates)
    return updates


STOP_TEXT = "hello world, the quick brown fox jumps over the lazy dog."


@pytest.mark.parametrize("chunk_sizes", [(1,), (2,), (9,), (100,)])
def test_stop_string_inside_one_token(any_tokenizer, chunk_sizes):
    output_ids = _encode(any_tokenizer, STOP_TEXT)
    # The first token whose text past its first character (>= 2 characters) first occurs there.
    stop = None
    for k in range(len(output_ids)):
        start = len(_decode(any_tokenizer, output_ids[:k]))
        inner = _decode(any_tokenizer, output_ids[: k + 1])[start + 1 :]
        if len(inner) >= 2 and STOP_TEXT.find(inner) == start + 1:
            stop = inner
            break
    assert stop is not None
    logger.info("stop string %r inside one token", stop)
    updates = _check_stop(any_tokenizer, _encode(any_tokenizer, STOP_TEXT), (stop,), chunk_sizes)
    assert "".join(u.text for u in updates) == STOP_TEXT[: STOP_TEXT.find(stop)]


@pytest.mark.parametrize("chunk_sizes", [(1,), (3,), (100,)])
def test_stop_string_across_tokens(any_tokenizer, chunk_sizes):
    output_ids = _encode(any_tokenizer, STOP_TEXT)
    token_texts = [_decode(any_tokenizer, [t]) for t in output_ids]
    boundaries = [len(_decode(any_tokenizer, output_ids[:k])) for k in range(2, len(output_ids))]
    # A 4-character stop string whose characters come from two different tokens.
    stop = next(
        STOP_TEXT[b - 2 : b + 2]
        for b in boundaries
        if not any(STOP_TEXT[b - 2 : b + 2] in t for t in token_texts)
    )
    updates = _check_stop(any_tokenizer, _encode(any_tokenizer, STOP_TEXT), (stop,), chunk_sizes)
    assert "".join(u.text for u in updates) == STOP_TEXT[: STOP_TEXT.find(stop)]


def test_stop_string_at_the_very_start(any_tokenizer):
    updates = _check_stop(any_tokenizer, _encode(any_tokenizer, STOP_TEXT), ("hel",), (1,))
    assert "".join(u.text for u in updates) == ""


def test_earliest_stop_string_wins(any_tokenizer):
    updates = _check_stop(
        any_tokenizer, _encode(any_tokenizer, STOP_TEXT), ("lazy", "fox", "quick"), (4,)
    )
    assert updates[-1].stop_string == "quick"
    assert "".join(u.text for u in updates) == "hello world, the "


def test_first_completing_stop_string_wins_inside_one_token():
    tokenizer = _llama_byte_fallback()
    output_ids = _encode(tokenizer, STOP_TEXT)
    token_text = max((_decode(tokenizer, [t]) for t in output_ids), key=len)
    assert len(token_text) >= 8 and STOP_TEXT.count(token_text) == 1
    early, late, longer = token_text[1:4], token_text[-3:], token_text[0:4]
    # Listed first, completing later: loses.
    updates = _check_stop(tokenizer, _encode(tokenizer, STOP_TEXT), (late, early), (1,))
    assert updates[-1].stop_string == early
    # Same end: the longer one (earlier start) wins.
    updates = _check_stop(tokenizer, _encode(tokenizer, STOP_TEXT), (early, longer), (1,))
    assert updates[-1].stop_string == longer


@pytest.mark.parametrize("seed", range(4))
def test_random_stop_strings_byte_level(byte_level, seed):
    rng = random.Random(100 + seed)
    output_ids = [rng.randrange(3, len(byte_level)) for _ in range(120)]
    full_text = _decode(byte_level, output_ids)
    stops = []
    while len(stops) < 2:
        start = rng.randrange(len(full_text) - 3)
        stop = full_text[start : start + rng.randint(1, 3)]
        if "\ufffd" not in stop:
            stops.append(stop)
    _check_stop(byte_level, output_ids, tuple(stops), (rng.randint(1, 9),))


def test_stop_string_completing_first_wins_over_earlier_start(byte_level):
    # "abcd" starts first but "bc" completes first, whatever the token boundaries.
    for chunk_sizes in [(1,), (100,)]:
        updates = _check_stop(
            byte_level, _encode(byte_level, "xx abcd yy"), ("abcd", "bc"), chunk_sizes
        )
        assert updates[-1].stop_string == "bc"
        assert "".join(u.text for u in updates) == "xx a"


def test_stop_string_in_multi_token_append_reports_tokens_kept(byte_level):
    text = "Hello world, the quick brown fox jumps over the lazy dog."
    output_ids = _encode(byte_level, text)
    detok = IncrementalDetokenizer(byte_level, [], SamplingParams(stop=("brown",)))
    first = detok.append(output_ids[:3])
    update = detok.append(output_ids[3:])
    j = next(
        j for j in range(1, len(output_ids) + 1) if "brown" in _decode(byte_level, output_ids[:j])
    )
    assert first.num_tokens_kept == 3 and j > 3
    assert update == DetokenizerUpdate(
        text=text[: text.find("brown")][len(first.text) :],
        num_tokens_kept=j - 3,
        stop_string="brown",
    )
    with pytest.raises(AssertionError):
        detok.append(output_ids[:1])


def test_stop_string_made_of_multibyte_characters(any_tokenizer):
    _check_stop(any_tokenizer, _encode(any_tokenizer, "你好 中文 测试 🙂 smile"), ("文 测",), (1,))
    _check_stop(any_tokenizer, _encode(any_tokenizer, "你好 中文 测试 🙂 smile"), ("🙂",), (2,))


def test_stop_string_found_in_the_token_that_also_starts_a_character(byte_level):
    output_ids = _encode(byte_level, "ok 测试")
    # The token that brings the space also brings the first byte of "测".
    j = next(j for j in range(1, len(output_ids)) if " " in _decode(byte_level, output_ids[:j]))
    assert _decode(byte_level, output_ids[:j]).endswith(" \ufffd")
    updates = _check_stop(byte_level, output_ids, (" ",), (1,))
    assert sum(u.num_tokens_kept for u in updates) == j


def test_held_back_text_released_by_flush(byte_level):
    text = "The quick brown fox jumps over the lazy dog"
    output_ids = _encode(byte_level, text)
    detok = IncrementalDetokenizer(byte_level, [], SamplingParams(stop=("dog!", "xyz")))
    update = detok.append(output_ids)
    assert update.stop_string is None and update.num_tokens_kept == len(output_ids)
    assert update.text == "The quick brown fox jumps over the lazy "
    assert detok.flush() == "dog"
    assert detok.output_text == text
    with pytest.raises(AssertionError):
        detok.append(output_ids[:1])


def test_partial_character_released_by_flush(byte_level):
    ids = _encode(byte_level, "ok 测试")
    # Cut the emoji's tokens short so that the output ends inside a character.
    partial = next(
        ids[:j] for j in range(len(ids), 0, -1) if _decode(byte_level, ids[:j]).endswith("\ufffd")
    )
    detok = IncrementalDetokenizer(byte_level, [], SamplingParams())
    update = detok.append(partial)
    assert "\ufffd" not in update.text
    assert update.text + detok.flush() == _decode(byte_level, partial)


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(byte_level, skip):
    im_end = byte_level.convert_tokens_to_ids("<|im_end|>")
    output_ids = _encode(byte_level, "Hi there 🙂") + [im_end] + _encode(byte_level, " bye")
    _, updates, flushed = _run(
        byte_level, [], output_ids, (1,), SamplingParams(skip_special_tokens=skip)
    )
    emitted = "".join(u.text for u in updates) + flushed
    assert emitted == ("Hi there 🙂<|im_end|> bye" if not skip else "Hi there 🙂 bye")


def test_empty_append(byte_level):
    detok = IncrementalDetokenizer(byte_level, [1, 2], SamplingParams(stop=("x",)))
    assert detok.append([]) == DetokenizerUpdate(text="", num_tokens_kept=0, stop_string=None)
