"""Hermes-style tool calls, as Qwen2.5, Qwen3 and the Hermes models write them:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call, blocks separated by a newline. The scanner reads a call's header (the tag,
then `{"name": <string>, "arguments": {`, any whitespace between the JSON tokens) before it
commits to it; arguments are followed to the end of their object by bracket depth (strings and
escapes skipped), then `}` and the closing tag are expected. A header that does not match is
content, the tag included.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from server.tool_parsers.base import (
    CallArguments,
    CallEnd,
    CallScanner,
    CallStart,
    Event,
    FunctionSpec,
    Text,
    ToolParser,
    is_json_object,
)
from server.tool_parsers.scanning import STRING, Pattern, held_prefix

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
# A header longer than this is not one (names are at most 64 characters): stop holding it back.
MAX_HEADER_CHARS = 512


def _header() -> Pattern:
    return Pattern("{", '"name"', ":", STRING, ",", '"arguments"', ":", "{")


def _trailer() -> Pattern:
    return Pattern("}", CLOSE)


class HermesScanner(CallScanner):
    """Follows one output through `<tool_call>` blocks (see the module docstring)."""

    def __init__(self) -> None:
        self._mode = "text"  # text, header, arguments, trailer, broken
        self._held = ""  # text: a possible start of OPEN; broken: of CLOSE
        self._raw = ""  # the current call's text so far
        self._pattern = _header()
        self._num_calls = 0
        self._arguments = ""
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._readers = {
            "text": self._read_text,
            "header": self._read_header,
            "arguments": self._read_arguments,
            "trailer": self._read_trailer,
            "broken": self._read_broken,
        }

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        while text:
            text = self._readers[self._mode](text, events)
        return _merged(events)

    def finish(self, is_cut: bool = False) -> list[Event]:
        events: list[Event] = []
        if self._mode == "text":
            if self._held and not is_cut:
                events.append(Text(self._held))
            self._held = ""
        elif self._mode == "header":
            if is_cut:  # every character since the tag still matched a header: markup
                self._restart()
            else:
                events.append(Text(OPEN))
                events.extend(self.feed(self._restart()))
                events.extend(self.finish())
        else:
            # Ended inside a call: only arguments read whole may make a valid call.
            is_valid = self._mode == "trailer" and is_json_object(self._arguments)
            events.append(self._end(is_valid, is_cut))
        return _merged(events)

    # ---- one method per mode: consume from `text`, return what is left to read

    def _read_text(self, text: str, events: list[Event]) -> str:
        pending = self._held + text
        start = pending.find(OPEN)
        if start < 0:
            num_held = held_prefix(pending, OPEN)
            self._held = pending[len(pending) - num_held :]
            if len(pending) > num_held:
                events.append(Text(pending[: len(pending) - num_held]))
            return ""
        if start:
            events.append(Text(pending[:start]))
        self._held = ""
        self._mode, self._raw, self._pattern = "header", OPEN, _header()
        return pending[start + len(OPEN) :]

    def _read_header(self, text: str, events: list[Event]) -> str:
        for i, c in enumerate(text):
            self._raw += c
            matched = self._pattern.push(c)
            if matched is False or len(self._raw) > MAX_HEADER_CHARS:
                # Not a call: the tag is content, and what followed it is read again as text.
                events.append(Text(OPEN))
                return self._restart() + text[i + 1 :]
            if matched:
                name = json.loads(self._pattern.string)
                index = self._num_calls
                self._num_calls += 1
                events += [CallStart(index, name), CallArguments(index, "{")]
                self._mode, self._arguments = "arguments", "{"
                self._depth, self._in_string, self._escaped = 1, False, False
                return text[i + 1 :]
        return ""

    def _restart(self) -> str:
        """Back to text after a header that did not match: its characters, to read again."""
        again = self._raw[len(OPEN) :]
        self._mode, self._raw = "text", ""
        return again

    def _read_arguments(self, text: str, events: list[Event]) -> str:
        for i, c in enumerate(text):
            if self._escaped:
                self._escaped = False
            elif self._in_string:
                self._escaped = c == "\\"
                self._in_string = c != '"'
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._add_arguments(text[: i + 1], events)
                    self._mode, self._pattern = "trailer", _trailer()
                    return text[i + 1 :]
        self._add_arguments(text, events)
        return ""

    def _read_trailer(self, text: str, events: list[Event]) -> str:
        for i, c in enumerate(text):
            self._raw += c
            self._held += c
            matched = self._pattern.push(c)
            if matched:
                events.append(self._end(is_json_object(self._arguments)))
                return text[i + 1 :]
            if matched is False:
                # The markup broke after the arguments: the rest of the call, up to its closing
                # tag, is read as more arguments (they are then not JSON: the call is invalid).
                again = self._held + text[i + 1 :]
                self._raw = self._raw[: len(self._raw) - len(self._held)]
                self._held, self._mode = "", "broken"
                return again
        return ""

    def _read_broken(self, text: str, events: list[Event]) -> str:
        pending = self._held + text
        end = pending.find(CLOSE)
        if end < 0:
            num_held = held_prefix(pending, CLOSE)
            self._raw += text
            self._held = pending[len(pending) - num_held :]
            self._add_arguments(pending[: len(pending) - num_held], events, raw=False)
            return ""
        self._raw += text[: end + len(CLOSE) - len(self._held)]
        self._add_arguments(pending[:end], events, raw=False)
        events.append(self._end(False))
        return pending[end + len(CLOSE) :]

    def _add_arguments(self, text: str, events: list[Event], raw: bool = True) -> None:
        if raw:
            self._raw += text
        if text:
            self._arguments += text
            events.append(CallArguments(self._num_calls - 1, text))

    def _end(self, is_valid: bool, is_cut: bool = False) -> CallEnd:
        end = CallEnd(self._num_calls - 1, is_valid, self._raw, is_cut)
        self._mode, self._raw, self._held, self._arguments = "text", "", "", ""
        return end


def _merged(events: list[Event]) -> list[Event]:
    """Adjacent texts, and adjacent argument pieces of one call, as one event each."""
    out: list[Event] = []
    for event in events:
        last = out[-1] if out else None
        if isinstance(event, Text) and isinstance(last, Text):
            out[-1] = Text(last.text + event.text)
        elif (
            isinstance(event, CallArguments)
            and isinstance(last, CallArguments)
            and last.index == event.index
        ):
            out[-1] = CallArguments(event.index, last.text + event.text)
        else:
            out.append(event)
    return out


class HermesParser(ToolParser):
    """`<tool_call>` JSON blocks (Qwen2.5, Qwen3, Hermes 2/3)."""

    name = "hermes"
    template_markers = (OPEN,)
    model_types = ("qwen2", "qwen3")

    def scanner(self) -> HermesScanner:
        return HermesScanner()

    def _structural_tag(
        self, functions: Sequence[FunctionSpec], parallel_tool_calls: bool
    ) -> dict[str, Any]:
        tags = [
            {
                "type": "tag",
                "begin": OPEN + "\n",
                "content": {
                    "type": "sequence",
                    "elements": [
                        {
                            "type": "const_string",
                            "value": f'{{"name": {json.dumps(f.name)}, "arguments": ',
                        },
                        # One whitespace character at most between JSON tokens: unbounded,
                        # a sampled model can spend every token on spaces and never finish.
                        {
                            "type": "json_schema",
                            "json_schema": f.parameters,
                            "max_whitespace_cnt": 1,
                        },
                        {"type": "const_string", "value": "}"},
                    ],
                },
                "end": "\n" + CLOSE,
            }
            for f in functions
        ]
        return {
            "type": "structural_tag",
            "format": {
                "type": "tags_with_separator",
                "tags": tags,
                "separator": "\n",
                "at_least_one": True,
                "stop_after_first": not parallel_tool_calls,
            },
        }
