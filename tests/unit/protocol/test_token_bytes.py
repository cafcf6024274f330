"""Token text for logprobs and streams: token bytes that rebuild the text, partial and whole tokens,
text offsets, and the splitter that gives one output per token."""

from __future__ import annotations

from dataclasses import replace

import pytest
from transformers import PreTrainedTokenizerFast

from server.streaming import TokenSplitter
from server.token_bytes import TextOffsets, TokenDecoder
from tests.tiny_tokenizers import llama_byte_fallback
from tests.unit.protocol.helpers import CORPUS, TEXT, delta_between, make_output, train_byte_level


def _llama_byte_fallback() -> PreTrainedTokenizerFast:
    return llama_byte_fallback(CORPUS, 120)


@pytest.fixture(scope="module", params=["byte_level", "llama_byte_fallback"])
def any_tokenizer(request) -> PreTrainedTokenizerFast:
    return {"byte_level": train_byte_level, "llama_byte_fallback": _llama_byte_fallback}[
        request.param
    ]()


def test_token_bytes_rebuild_the_text(any_tokenizer):
    tokens = TokenDecoder(any_tokenizer)
    ids = any_tokenizer.encode(TEXT, add_special_tokens=False)
    rebuilt = b"".join(tokens.token_bytes(t) for t in ids)
    # The Llama-style normalizer writes a leading "▁" that the full decode strips.
    assert rebuilt.decode() in (TEXT, " " + TEXT)
    assert any(len(tokens.token_bytes(t)) == 1 and tokens.token_bytes(t)[0] >= 0x80 for t in ids)


def test_token_text_of_partial_and_whole_tokens(byte_level):
    tokens = TokenDecoder(byte_level)
    assert tokens.is_byte_level
    for token_id in byte_level.encode(TEXT, add_special_tokens=False):
        raw = tokens.token_bytes(token_id)
        try:
            whole = raw.decode("utf-8")
        except UnicodeDecodeError:
            assert "\ufffd" in tokens.token_text(token_id)
        else:
            assert tokens.token_text(token_id) == whole == byte_level.decode([token_id])
    eos = byte_level.eos_token_id
    assert (tokens.token_text(eos), tokens.token_bytes(eos)) == ("<|endoftext|>", b"<|endoftext|>")


def test_text_offsets_point_at_each_token(byte_level):
    tokens = TokenDecoder(byte_level)
    ids = byte_level.encode(TEXT, add_special_tokens=False)
    offsets = TextOffsets(tokens)
    split = len(ids) // 2
    streamed = offsets.advance(ids[:split]) + offsets.advance(ids[split:])
    assert streamed == TextOffsets(tokens).advance(ids)
    assert offsets.position == len(TEXT)
    assert streamed == sorted(streamed) and streamed[0] == 0
    for token_id, offset in zip(ids, streamed, strict=True):
        text = tokens.token_text(token_id)
        if "\ufffd" not in text:
            assert TEXT[offset : offset + len(text)] == text


def test_token_splitter_gives_one_output_per_token(byte_level):
    # Choice 0 gains 3 tokens in the first step, choice 1 one; the second step ends both.
    wholes = [make_output(byte_level, TEXT, cut, finish=None, logprobs=0) for cut in (3, 1)]
    final = make_output(byte_level, TEXT, logprobs=0, n=2)
    first = replace(final, outputs=[replace(w.outputs[0], index=i) for i, w in enumerate(wholes)])
    first = replace(first, finished=False)
    steps = [delta_between(None, first), delta_between(first, final)]
    splitter = TokenSplitter(TokenDecoder(byte_level))
    pieces = [piece for step in steps for piece in splitter.split(step)]
    assert [p.finished for p in pieces] == [False] * (len(pieces) - 1) + [True]
    assert [len(p.outputs[1].token_ids) for p in pieces[:3]] == [1, 0, 0]  # it waits its turn
    ids = byte_level.encode(TEXT, add_special_tokens=False)
    for i in (0, 1):
        mine = [p.outputs[i] for p in pieces]
        assert all(len(c.token_ids) <= 1 for c in mine)
        assert [t for c in mine for t in c.token_ids] == ids
        assert [e.token_id for c in mine for e in c.logprobs] == ids
        assert "".join(c.text for c in mine) == TEXT
        counts = [c.num_output_tokens for c in mine]
        assert counts == sorted(counts) and counts[-1] == len(ids)
        last = max(j for j, c in enumerate(mine) if c.token_ids)
        assert all(c.finish_reason is None for c in mine[:last])
        assert all(c.finish_reason == "stop" and c.spec_stats for c in mine[last:])
