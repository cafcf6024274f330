"""Replies read through a tool parser, validated against the official OpenAPI spec: calls in the
message with content null and finish reason "tool_calls" ("stop" for a named function); streamed
as `delta.tool_calls` fragments (id, type and name first, then arguments pieces) that add up to
the same calls, at every step size, with no markup in the content, also in a reply cut by
max_tokens inside a call; each of n choices read on its own."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from server.response_builders import ChatStream, build_chat_response
from server.token_bytes import TokenDecoder
from server.tool_parsers import get_parser
from server.tool_parsers.base import NamedCallParser
from tests.unit.protocol.helpers import META, check_body

HERMES = get_parser("hermes")
ARGS = '{"city": "Paris", "days": 3}'
CALL = f'<tool_call>\n{{"name": "get_weather", "arguments": {ARGS}}}\n</tool_call>'
TWO_CALLS = f'Checking.\n{CALL}\n<tool_call>\n{{"name": "now", "arguments": {{}}}}\n</tool_call>'
PLAIN = "No tools needed here."


def outputs(tokenizer, texts: list[str], sizes: list[int], finish: str = "stop") -> list[Any]:
    """The engine's per-step outputs of choices spelling `texts`, each step adding up to the
    next of `sizes` tokens to every choice (repeated until every text is out)."""
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    steps, done = [], [0] * len(texts)
    for size in sizes * max(len(i) for i in ids):
        if all(d == len(i) for d, i in zip(done, ids, strict=True)):
            break
        completions = []
        for index, (token_ids, start) in enumerate(zip(ids, done, strict=True)):
            end = min(start + size, len(token_ids))
            before = tokenizer.decode(token_ids[:start])
            text = tokenizer.decode(token_ids[:end])[len(before) :]
            completions.append(CompletionOutput(index, text, token_ids[start:end], None, None))
            done[index] = end
        steps.append(RequestOutput("r", "p", [1, 2, 3], completions, finished=False))
    finished = [
        replace(c, finish_reason=finish, num_output_tokens=len(ids[c.index]))
        for c in steps[-1].outputs
    ]
    return [*steps[:-1], replace(steps[-1], outputs=finished, finished=True)]


def whole(tokenizer, texts: list[str], finish: str = "stop") -> RequestOutput:
    completions = [
        CompletionOutput(i, t, tokenizer.encode(t, add_special_tokens=False), None, finish)
        for i, t in enumerate(texts)
    ]
    return RequestOutput("r", "p", [1, 2, 3], completions, finished=True)


def test_reply_with_calls_matches_spec(validators, byte_level):
    output = whole(byte_level, [TWO_CALLS, PLAIN])
    response = build_chat_response(META, output, TokenDecoder(byte_level), tool_parser=HERMES)
    body = check_body(validators["CreateChatCompletionResponse"], response)
    called, plain = body["choices"]
    assert called["finish_reason"] == "tool_calls"
    assert called["message"]["content"] == "Checking."
    calls = called["message"]["tool_calls"]
    assert [(c["type"], c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("function", "get_weather", ARGS),
        ("function", "now", "{}"),
    ]
    assert all(c["id"].startswith("call_") for c in calls) and calls[0]["id"] != calls[1]["id"]
    assert plain["message"] == {"role": "assistant", "content": PLAIN, "refusal": None}
    assert plain["finish_reason"] == "stop"


# Cut inside the header ("<tool_call>\n{"name": "get_weat") and inside the arguments.
CUT_IN_HEADER, CUT_IN_ARGUMENTS = CALL[:30], CALL[:60]


def test_a_reply_cut_short_keeps_length_and_no_markup(validators, byte_level):
    output = whole(byte_level, [CALL, CUT_IN_HEADER, CUT_IN_ARGUMENTS], finish="length")
    response = build_chat_response(META, output, TokenDecoder(byte_level), tool_parser=HERMES)
    body = check_body(validators["CreateChatCompletionResponse"], response)
    assert [c["finish_reason"] for c in body["choices"]] == ["length"] * 3
    messages = [c["message"] for c in body["choices"]]
    assert [m["content"] for m in messages] == [None, None, None]
    # A call cut short keeps the arguments written so far; a header cut short is no call.
    assert [[c["function"]["arguments"] for c in m.get("tool_calls") or []] for m in messages] == [
        [ARGS],
        [],
        ['{"city": "P'],
    ]


@pytest.mark.parametrize("sizes", [[1], [3], [1000]])
def test_a_streamed_reply_cut_short_reads_as_the_whole_one(validators, byte_level, sizes):
    texts = [CALL, CUT_IN_HEADER, CUT_IN_ARGUMENTS]
    stream = ChatStream(META, TokenDecoder(byte_level), tool_parser=HERMES)
    bodies = [
        check_body(validators["CreateChatCompletionStreamResponse"], chunk)
        for step in outputs(byte_level, texts, sizes, finish="length")
        for chunk in stream.chunks(step)
    ]
    output = whole(byte_level, texts, finish="length")
    response = build_chat_response(META, output, TokenDecoder(byte_level), tool_parser=HERMES)
    for index, choice in enumerate(response.choices):
        content, calls, reasons = _collect(bodies, index)
        assert content == "" and reasons[-1] == "length"
        expected = [
            (c.function.name, c.function.arguments) for c in choice.message.tool_calls or []
        ]
        assert [(c["name"], c["arguments"]) for c in calls] == expected


def test_a_named_function_finishes_with_stop(validators, byte_level):
    """OpenAI finishes a choice forced to call a named function with "stop", not "tool_calls"."""
    named = NamedCallParser(HERMES)
    output = whole(byte_level, [CALL, CALL[:60]], finish="stop")
    response = build_chat_response(META, output, TokenDecoder(byte_level), tool_parser=named)
    body = check_body(validators["CreateChatCompletionResponse"], response)
    assert [c["finish_reason"] for c in body["choices"]] == ["stop", "stop"]
    assert body["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] == ARGS
    stream = ChatStream(META, TokenDecoder(byte_level), tool_parser=named)
    bodies = [
        check_body(validators["CreateChatCompletionStreamResponse"], chunk)
        for step in outputs(byte_level, [CALL], [2])
        for chunk in stream.chunks(step)
    ]
    content, calls, reasons = _collect(bodies, 0)
    assert (content, [c["arguments"] for c in calls], reasons[-1]) == ("", [ARGS], "stop")


def test_without_a_parser_calls_are_text(byte_level):
    response = build_chat_response(META, whole(byte_level, [CALL]), TokenDecoder(byte_level))
    assert response.choices[0].message.content == CALL
    assert response.choices[0].finish_reason == "stop"


def _collect(bodies: list[dict[str, Any]], index: int) -> tuple[str, list[dict[str, str]], list]:
    """One choice's streamed content, calls (added up by index) and finish reasons."""
    content, calls, reasons = "", {}, []
    for body in bodies:
        for choice in body["choices"]:
            if choice["index"] != index:
                continue
            delta = choice["delta"]
            content += delta.get("content") or ""
            for fragment in delta.get("tool_calls", []):
                call = calls.setdefault(fragment["index"], {"arguments": ""})
                if "id" in fragment:
                    assert "id" not in call and fragment["type"] == "function"
                    assert call["arguments"] == ""  # the name comes before any argument
                    call["id"], call["name"] = fragment["id"], fragment["function"]["name"]
                call["arguments"] += fragment["function"].get("arguments", "")
            reasons.append(choice["finish_reason"])
    return content, [calls[i] for i in sorted(calls)], reasons


@pytest.mark.parametrize("sizes", [[1], [2, 5], [3], [1000]])
def test_streamed_calls_add_up_to_the_reply(validators, byte_level, sizes):
    stream = ChatStream(META, TokenDecoder(byte_level), tool_parser=HERMES)
    steps = outputs(byte_level, [TWO_CALLS, PLAIN], sizes)
    bodies = [
        check_body(validators["CreateChatCompletionStreamResponse"], chunk)
        for step in steps
        for chunk in stream.chunks(step)
    ]
    content, calls, reasons = _collect(bodies, 0)
    assert content == "Checking."  # no markup, no whitespace around the calls
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", ARGS), ("now", "{}")]
    assert len({c["id"] for c in calls}) == 2
    assert reasons[-1] == "tool_calls" and reasons.count("tool_calls") == 1
    content, calls, reasons = _collect(bodies, 1)
    assert (content, calls, reasons[-1]) == (PLAIN, [], "stop")
    if sizes == [1]:  # arguments come in pieces, as the model writes them
        fragments = [
            f for b in bodies for c in b["choices"] for f in c["delta"].get("tool_calls", [])
        ]
        assert len(fragments) > 10


def test_streamed_chunks_carry_logprobs_once(byte_level):
    stream = ChatStream(META, TokenDecoder(byte_level), tool_parser=HERMES)
    steps = [
        replace(
            s,
            outputs=[
                replace(c, logprobs=[TokenLogprob(t, -1.0, (), ()) for t in c.token_ids])
                for c in s.outputs
            ],
        )
        for s in outputs(byte_level, [CALL], [4])
    ]
    chunks = [chunk for step in steps for chunk in stream.chunks(step)]
    entries = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert len(entries) == len(byte_level.encode(CALL, add_special_tokens=False))
    assert json.loads(chunks[-1].model_dump_json())["choices"][0]["finish_reason"] == "tool_calls"
