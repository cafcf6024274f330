"""The hermes tool-call parser: whole outputs and streams read the same, at every split of the
text into pieces; markup never reaches content, also where max_tokens cut the output inside a
call or its markup; what is not a call stays content; the registry picks parsers from the
setting, the chat template and the model type."""

from __future__ import annotations

import re

import pytest

from server.tool_parsers import get_parser, select_parser
from server.tool_parsers.base import (
    CallArguments,
    CallStart,
    FirstCallParser,
    ParsedCall,
    ParsedMessage,
    Text,
)

HERMES = get_parser("hermes")


def call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


WEATHER_ARGS = '{"city": "Paris", "days": 3}'
WEATHER = call("get_weather", WEATHER_ARGS)
NESTED_ARGS = '{"q": "a } and { and \\" and </tool_call>", "tags": [{"x": [1, 2]}]}'
NESTED = call("search", NESTED_ARGS)

# (id, text, content, [(name, arguments)])
VALID = [
    ("plain", "Hello world, no calls.", "Hello world, no calls.", []),
    ("plain-space", "  spaced \n", "  spaced \n", []),
    ("angle-brackets", "a < b and <tool or <tool_cal", "a < b and <tool or <tool_cal", []),
    ("one", WEATHER, None, [("get_weather", WEATHER_ARGS)]),
    ("nested", NESTED, None, [("search", NESTED_ARGS)]),
    ("empty-args", call("now", "{}"), None, [("now", "{}")]),
    (
        "text-then-two",
        f"Let me check.\n{WEATHER}\n{call('now', '{}')}",
        "Let me check.",
        [("get_weather", WEATHER_ARGS), ("now", "{}")],
    ),
    ("call-then-text", f"{WEATHER}\n\nDone.", "Done.", [("get_weather", WEATHER_ARGS)]),
    (
        "loose-spacing",
        '<tool_call>{ "name" :"f","arguments":{"a":1} }</tool_call>',
        None,
        [("f", '{"a":1}')],
    ),
    (
        "unicode-name",
        call("f\\u00e9", '{"s": "caf\\u00e9 🙂"}'),
        None,
        [("fé", '{"s": "caf\\u00e9 🙂"}')],
    ),
    ("tag-twice", f"<tool_call>{WEATHER}", "<tool_call>", [("get_weather", WEATHER_ARGS)]),
    # Cut after the arguments: they are whole, only the closing markup is missing.
    ("no-closing-tag", WEATHER[:-13], None, [("get_weather", WEATHER_ARGS)]),
]
# Not calls: the header (tag, name, "arguments") does not match, so it is content throughout.
NOT_CALLS = [
    "<tool_call>\nnot json\n</tool_call>",
    '<tool_call>\n{"arguments": {}, "name": "f"}\n</tool_call>',
    '<tool_call>\n{"name": 5, "arguments": {}}\n</tool_call>',
    '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>',
    '<tool_call>\n{"name": "f\nx", "arguments": {}}\n</tool_call>',
    '<tool_call>\n{"name": "f", "arguments": ',  # cut inside the header
    "Plain text, then <tool_call> and nothing",
]
# Calls whose header is fine but whose arguments or closing markup are not.
BROKEN = [
    '<tool_call>\n{"name": "f", "arguments": {"a": }}\n</tool_call> after',
    '<tool_call>\n{"name": "f", "arguments": {"a": 1}} junk\n</tool_call>',
    '<tool_call>\n{"name": "f", "arguments": {"a": "unfinished',
]


def streamed(pieces: list[str], parser=HERMES, is_cut: bool = False) -> ParsedMessage:
    """The message a stream of `pieces` spells: content and calls added up from its events."""
    stream = parser.stream()
    events = [e for piece in pieces for e in stream.feed(piece)] + stream.finish(is_cut)
    content = "".join(e.text for e in events if isinstance(e, Text))
    names = {e.index: e.name for e in events if isinstance(e, CallStart)}
    arguments = {
        i: "".join(e.text for e in events if isinstance(e, CallArguments) and e.index == i)
        for i in names
    }
    assert list(names) == list(range(len(names)))  # indexes 0, 1, ... in order
    ids = [stream.call_id(i) for i in names]
    calls = [(names[i], arguments[i]) for i in names]
    return ParsedMessage(
        content or None, tuple(ParsedCall(ids[i], *c) for i, c in enumerate(calls))
    )


def simple(message: ParsedMessage) -> tuple[str | None, list[tuple[str, str]]]:
    return message.content, [(c.name, c.arguments) for c in message.calls]


def splits(text: str) -> list[list[str]]:
    """Every cut of `text` into two pieces, a cut into three around each third, and every
    character alone."""
    cuts = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    third = len(text) // 3
    cuts += [[text[:i], text[i:j], text[j:]] for i in range(third) for j in (i + third, 2 * third)]
    return [*cuts, list(text)]


@pytest.mark.parametrize(
    ("text", "content", "calls"), [c[1:] for c in VALID], ids=[c[0] for c in VALID]
)
def test_whole_and_streamed_outputs_read_the_same(text, content, calls):
    assert simple(HERMES.parse(text)) == (content, calls)
    for pieces in splits(text):
        assert simple(streamed(pieces)) == (content, calls), pieces


@pytest.mark.parametrize("text", [WEATHER, NESTED, f"Sure.\n{WEATHER}\n{NESTED}\nDone."])
def test_markup_never_reaches_streamed_content(text):
    for pieces in splits(text):
        stream = HERMES.stream()
        events = [e for piece in pieces for e in stream.feed(piece)] + stream.finish()
        for event in events:
            if isinstance(event, Text):
                assert "<" not in event.text and '"' not in event.text, pieces


@pytest.mark.parametrize("text", NOT_CALLS)
def test_what_is_not_a_call_stays_content(text):
    assert simple(HERMES.parse(text)) == (text, [])
    for pieces in splits(text):
        assert simple(streamed(pieces)) == (text, [])


@pytest.mark.parametrize("text", BROKEN)
def test_broken_calls_are_content_whole_and_calls_streamed(text):
    # A stream has sent the name before the arguments broke: it cannot take the call back, so
    # the call keeps everything written up to its closing tag; the whole output reads as text.
    assert simple(HERMES.parse(text)) == (text, [])
    results = {repr(simple(streamed(pieces))) for pieces in splits(text)}
    assert len(results) == 1
    content, calls = simple(streamed([text]))
    assert [name for name, _ in calls] == ["f"]
    assert calls[0][1].startswith('{"a": ') and "</tool_call>" not in calls[0][1]
    assert content == ("after" if text.endswith(" after") else None)


CALLS_ONLY = f"{WEATHER}\n{NESTED}"


def _cut_calls(text: str, size: int) -> list[tuple[str, str]]:
    """The calls of `text` cut after `size` characters: each whose header (up to its arguments'
    opening brace) is in, with its arguments as far as they are."""
    calls = []
    for name, arguments in (("get_weather", WEATHER_ARGS), ("search", NESTED_ARGS)):
        header = call(name, arguments).split(arguments)[0]
        start = text.index(header + arguments) + len(header)  # the arguments' "{"
        if size > start:
            calls.append((name, text[start : min(size, start + len(arguments))]))
    return calls


@pytest.mark.parametrize("prefix", ["", "Let me check. "])
def test_a_cut_output_keeps_its_calls_and_drops_its_markup(prefix):
    """max_tokens cut the output anywhere: the calls whose header is read stay calls (the last
    with the arguments written so far), whole and streamed; markup not yet a call - a tag, a
    header - is dropped, never content."""
    text = prefix + CALLS_ONLY
    for size in range(len(text) + 1):
        cut = text[:size]
        expected = _cut_calls(text, size)
        content, calls = simple(HERMES.parse(cut, is_cut=True))
        assert calls == expected, cut
        assert content is None or prefix.startswith(content), (cut, content)
        assert (content, calls) == simple(streamed([cut], is_cut=True)), cut
        for pieces in splits(cut)[:: max(1, size // 4)]:
            assert simple(streamed(pieces, is_cut=True)) == (content, calls), pieces
    # Not cut, the model stopped by itself: what it wrote is its content (as ever).
    assert simple(HERMES.parse("a <tool_c")) == ("a <tool_c", [])
    assert simple(HERMES.parse("a <tool_c", is_cut=True)) == ("a ", [])


def test_ids_are_fresh_and_shaped_like_openai():
    message = HERMES.parse(f"{WEATHER}\n{WEATHER}")
    ids = [c.id for c in message.calls]
    assert len(set(ids)) == 2
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids)


def test_a_possible_tag_is_held_back_until_decided():
    stream = HERMES.stream()
    assert stream.feed("Hello <tool") == [Text("Hello")]  # the space waits for what follows
    assert stream.feed("box> ok") == [Text(" <toolbox> ok")]
    assert stream.feed("\n<tool_call>\n") == []
    assert stream.feed('{"name": "f", "arguments": {"a"') == [
        CallStart(0, "f"),
        CallArguments(0, '{"a"'),
    ]
    assert stream.feed(": 1}}\n</tool_call>\n") == [CallArguments(0, ": 1}")]
    assert stream.finish() == []  # the newline after a call is no content
    assert stream.has_calls


def test_select_parser():
    assert select_parser("auto", "... <tool_call> ...", "llama").name == "hermes"
    assert select_parser("auto", "{{ messages }}", "qwen2").name == "hermes"
    assert select_parser("auto", "{{ messages }}", "llama") is None
    assert select_parser("auto", None, None) is None
    assert select_parser("none", "<tool_call>", "qwen2") is None
    assert select_parser("hermes", None, "llama").name == "hermes"
    with pytest.raises(ValueError, match="unknown tool parser"):
        select_parser("mistral", None, None)


@pytest.mark.parametrize(
    ("text", "content", "calls"), [c[1:] for c in VALID], ids=[c[0] for c in VALID]
)
def test_without_parallel_calls_only_the_first_is_read(text, content, calls):
    """`parallel_tool_calls: false` under tool_choice "auto": the first call, whole and at every
    split of a stream; the content around the dropped calls is kept, their markup is not."""
    first = FirstCallParser(HERMES)
    assert simple(first.parse(text)) == (content, calls[:1])
    for pieces in splits(text)[:: max(1, len(text) // 20)]:
        assert simple(streamed(pieces, first)) == (content, calls[:1]), pieces
    two = f"{WEATHER}\nand then\n{NESTED}\n{call('now', '{}')}"
    assert simple(first.parse(two)) == ("and then", [("get_weather", WEATHER_ARGS)])
