"""Streamed chunks, validated against the official OpenAPI spec: chat and completion streams add
up to the non-streamed answer, send the role and the finish reason once, the usage and the
speculation stats when asked."""

from __future__ import annotations

from typing import Any

import pytest

from engine.core.counters import SpecStats
from engine.outputs import RequestOutput
from server.response_builders import ChatStream, CompletionStream, usage_of
from server.token_bytes import TextOffsets, TokenDecoder
from tests.unit.protocol.helpers import (
    CMPL_META,
    META,
    SPEC_0,
    SPEC_NONE,
    SPEC_RECORDS,
    TEXT,
    check_body,
    delta_between,
    make_output,
    spec_stats_of,
    with_spec_stats,
)


def _steps(tokenizer, text: str, sizes: list[int], **kw: Any) -> list[RequestOutput]:
    """The engine's outputs emitting `text`'s tokens in steps of the given sizes."""
    num_ids = len(tokenizer.encode(text, add_special_tokens=False))
    cuts, total = [], 0
    for size in sizes * num_ids:
        total = min(total + size, num_ids)
        cuts.append(total)
        if total == num_ids:
            break
    wholes = [make_output(tokenizer, text, cut, finish=None, **kw) for cut in cuts[:-1]]
    wholes.append(make_output(tokenizer, text, **kw))
    return [delta_between(b, a) for b, a in zip([None, *wholes], wholes, strict=False)]


@pytest.mark.parametrize("include_usage", [False, True])
def test_chat_stream_matches_spec_and_adds_up(validators, byte_level, include_usage):
    tokens = TokenDecoder(byte_level)
    stream = ChatStream(META, tokens, include_usage=include_usage)
    steps = _steps(byte_level, TEXT, [1, 3, 2], logprobs=1, n=2)
    chunks = [chunk for step in steps for chunk in stream.chunks(step)]
    usage_chunk = stream.usage_chunk()
    assert (usage_chunk is None) != include_usage
    bodies = [check_body(validators["CreateChatCompletionStreamResponse"], c) for c in chunks]
    for index in (0, 1):
        mine = [b["choices"][0] for b in bodies if b["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert mine[-1]["delta"] == {} and mine[-1]["finish_reason"] == "stop"
        assert all(c["finish_reason"] is None for c in mine[:-1])
        assert "".join(c["delta"].get("content", "") for c in mine) == TEXT
        entries = [e for c in mine if c["logprobs"] for e in c["logprobs"]["content"]]
        assert bytes(b for e in entries for b in e["bytes"]).decode() == TEXT
    assert all(b["usage"] is None and b["object"] == "chat.completion.chunk" for b in bodies)
    if include_usage:
        body = check_body(validators["CreateChatCompletionStreamResponse"], usage_chunk)
        assert body["choices"] == [] and body["usage"] == usage_of([steps[-1]]).model_dump()


def test_chat_stream_sends_the_role_and_the_finish_once(byte_level):
    # Steps add several tokens, and a finished choice's later outputs repeat its finish reason.
    stream = ChatStream(META, TokenDecoder(byte_level))
    whole = make_output(byte_level, TEXT, logprobs=0)
    first = make_output(byte_level, TEXT, 4, finish=None, logprobs=0)
    chunks = (
        stream.chunks(first)
        + stream.chunks(delta_between(first, whole))
        + stream.chunks(delta_between(whole, whole))
    )
    deltas = [c.choices[0].delta for c in chunks]
    assert [d.role for d in deltas] == ["assistant", None, None, None]
    assert "".join(d.content or "" for d in deltas) == TEXT
    entries = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(entries) == len(whole.outputs[0].token_ids)
    assert [c.choices[0].finish_reason for c in chunks][-1] == "stop"


def test_completion_stream_matches_spec_and_adds_up(validators, byte_level):
    tokens = TokenDecoder(byte_level)
    stream = CompletionStream(CMPL_META, tokens, n=1, include_usage=True)
    chunks = []
    for step in _steps(byte_level, TEXT, [2, 1], logprobs=0):
        chunks += stream.chunks(step, prompt_index=1)
    bodies = [check_body(validators["CompletionChunk"], c) for c in chunks]
    assert {b["choices"][0]["index"] for b in bodies} == {1}
    assert "".join(b["choices"][0]["text"] for b in bodies) == TEXT
    assert [b["choices"][0]["finish_reason"] for b in bodies][-2:] == [None, "stop"]
    offsets = [o for b in bodies for o in b["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == TextOffsets(tokens).advance(byte_level.encode(TEXT, add_special_tokens=False))
    final = check_body(validators["CompletionChunk"], stream.usage_chunk())
    assert final["choices"] == [] and final["usage"]["total_tokens"] == 6 + len(offsets)


@pytest.mark.parametrize("include_spec_stats", [False, True])
def test_streams_send_spec_stats_with_the_finish_reason(validators, byte_level, include_spec_stats):
    tokens = TokenDecoder(byte_level)
    steps = with_spec_stats(
        _steps(byte_level, TEXT, [1, 3, 2], n=2), [spec_stats_of(SPEC_RECORDS), SpecStats()]
    )
    expected = [SPEC_0, SPEC_NONE]
    chat = ChatStream(META, tokens, include_spec_stats=include_spec_stats)
    bodies = [
        check_body(validators["CreateChatCompletionStreamResponse"], chunk)
        for step in steps
        for chunk in chat.chunks(step)
    ]
    completion = CompletionStream(CMPL_META, tokens, n=2, include_spec_stats=include_spec_stats)
    bodies += [
        check_body(validators["CompletionChunk"], chunk)
        for step in steps
        for chunk in completion.chunks(step, prompt_index=1)
    ]
    choices = [b["choices"][0] for b in bodies]
    with_stats = [c for c in choices if "speculative_decoding_stats" in c]
    if not include_spec_stats:
        assert with_stats == []
        return
    # One per choice per stream, on the chunk with the finish reason; completions index 2 + i.
    assert [(c["index"], c["finish_reason"]) for c in with_stats] == [
        (0, "stop"),
        (1, "stop"),
        (2, "stop"),
        (3, "stop"),
    ]
    assert [c["speculative_decoding_stats"] for c in with_stats] == expected * 2
    assert sum(c["finish_reason"] is not None for c in choices) == 4
