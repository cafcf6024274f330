"""What every tool parser shares: the calls it finds, the events its scanner emits, and the
reading of those events into a whole message or a stream of fragments.

A parser's `CallScanner` follows one output's text piece by piece and says, as soon as it is
sure, which text is content and where a call starts, what its arguments are and where it ends.
Text that might still turn out to be markup (the start of a tag) is held back until it is
decided. Decisions depend on the characters only, never on how the text was cut into pieces, so
every split of one text reads the same.

A call is *committed* once its header (the markup and the function's name) has been read: a
stream sends the name at that point and the arguments as they come, and cannot take them back.
So a call whose arguments then turn out not to be JSON (or that the model ends inside) stays a
call in a stream, with the arguments as written; the whole-text reading (`read_message`) turns
such a call back into content, its raw text unchanged.

An output *cut* by a limit (max_tokens) is read the same whole and streamed, with no markup in
its content: a committed call the cut falls in stays a call with the arguments written so far
(the calls before it are whole), and the text held back as possible markup at the cut (a tag's
start, a header not yet read whole) is dropped. The model did not choose to end there, so that
text is the start of a call that never came, not content.

Whitespace that only separates content from a call (before a call, after one) is dropped, so a
reply made only of calls has no content (null).
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from engine.structured.spec import StructuredOutput


def new_call_id() -> str:
    """A fresh tool call id in OpenAI's shape: "call_" and 24 random alphanumerics."""
    return "call_" + uuid.uuid4().hex[:24]


# --------------------------------------------------------------------------- scanner events


@dataclass(frozen=True)
class Text:
    """Content: text outside any call markup."""

    text: str


@dataclass(frozen=True)
class CallStart:
    """A call is committed: its index among the output's calls and the function's name."""

    index: int
    name: str


@dataclass(frozen=True)
class CallArguments:
    """The next piece of a call's arguments (JSON text, as the model writes it)."""

    index: int
    text: str


@dataclass(frozen=True)
class CallEnd:
    """A call ended. `raw` is all of its text, markup included, for a reading that gives an
    invalid call back as content; `is_valid`: its arguments are a JSON object and its markup
    is whole (the closing tag may be missing only at the very end of the output); `is_cut`: the
    output was cut inside the call, which stays a call whatever its arguments."""

    index: int
    is_valid: bool
    raw: str
    is_cut: bool = False


Event = Text | CallStart | CallArguments | CallEnd


class CallScanner(ABC):
    """Follows one output's text through a model family's call markup."""

    @abstractmethod
    def feed(self, text: str) -> list[Event]:
        """The events that the next piece of the output decides (text may be held back)."""

    @abstractmethod
    def finish(self, is_cut: bool = False) -> list[Event]:
        """The output ended: everything still held back, decided. Ends any open call (as cut,
        given `is_cut`: a limit ended the output, not the model; then held-back markup is
        dropped)."""


# --------------------------------------------------------------------------- parsed calls


@dataclass(frozen=True)
class FunctionSpec:
    """A function the request offers: its name and its parameters' JSON schema."""

    name: str
    parameters: dict[str, Any]


@dataclass(frozen=True)
class ParsedCall:
    """One complete call: arguments are the JSON text the model wrote (a JSON object)."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ParsedMessage:
    """An output read whole: content (None when there is none) and the calls, in order."""

    content: str | None
    calls: tuple[ParsedCall, ...]


def is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


class ToolParser(ABC):
    """A model family's tool-call markup: parse outputs, stream them, constrain them.

    Subclasses set `name` (the registry's and the `tool_parser` setting's), the markers that
    identify their format in a chat template, the model types that use it, and implement
    `scanner` and `_structural_tag`.
    """

    name: ClassVar[str]
    template_markers: ClassVar[tuple[str, ...]] = ()
    model_types: ClassVar[tuple[str, ...]] = ()
    # The finish reason of a choice whose output holds calls and ended by itself.
    calls_finish_reason: ClassVar[Literal["tool_calls", "stop"]] = "tool_calls"

    @abstractmethod
    def scanner(self) -> CallScanner:
        """A fresh scanner for one output."""

    @abstractmethod
    def _structural_tag(
        self, functions: Sequence[FunctionSpec], parallel_tool_calls: bool
    ) -> dict[str, Any]:
        """The xgrammar structural tag (as a dict) whose outputs are one or more calls (exactly
        one without `parallel_tool_calls`) of `functions`, each with schema-valid arguments."""

    def structural_tag(
        self, functions: Sequence[FunctionSpec], tool_choice: str, parallel_tool_calls: bool
    ) -> StructuredOutput | None:
        """The constraint `tool_choice` asks for: "required" - one or more calls of any of
        `functions` (exactly one without `parallel_tool_calls`); a function's name - exactly one
        call of that one, whatever `parallel_tool_calls` says (as OpenAI answers a named
        choice); "auto" or "none" - nothing (None). After the last call allowed, the grammar
        allows only the end of the output."""
        if tool_choice in ("auto", "none"):
            return None
        if tool_choice != "required":
            functions = [f for f in functions if f.name == tool_choice]
            parallel_tool_calls = False
        if not functions:
            raise ValueError(f"tool_choice {tool_choice!r} names no function of the request.")
        tag = self._structural_tag(functions, parallel_tool_calls)
        return StructuredOutput.structural_tag(tag)

    def parse(self, text: str, is_cut: bool = False) -> ParsedMessage:
        """A whole output read into content and calls; invalid calls stay content. `is_cut`: a
        limit ended the output (see the module docstring)."""
        scanner = self.scanner()
        return read_message([*scanner.feed(text), *scanner.finish(is_cut)])

    def stream(self) -> CallStream:
        """A reader of one streamed output."""
        return CallStream(self.scanner())


class _OneCallParser(ToolParser):
    """A parser read through `inner` whose grammar, where one is compiled, allows one call."""

    def __init__(self, inner: ToolParser) -> None:
        self.inner = inner

    def scanner(self) -> CallScanner:
        return self.inner.scanner()

    def _structural_tag(
        self, functions: Sequence[FunctionSpec], parallel_tool_calls: bool
    ) -> dict[str, Any]:
        return self.inner._structural_tag(functions, False)


class FirstCallParser(_OneCallParser):
    """`parallel_tool_calls: false` where no grammar enforces it (tool_choice "auto"): the
    model's output read through `inner`, keeping its first call only, whole and streamed. The
    later calls are read (so the whitespace around them is dropped as around any call) and then
    left out."""

    name = "first-call"

    def parse(self, text: str, is_cut: bool = False) -> ParsedMessage:
        message = self.inner.parse(text, is_cut)
        return ParsedMessage(message.content, message.calls[:1])

    def stream(self) -> CallStream:
        return FirstCallStream(self.scanner())


class NamedCallParser(_OneCallParser):
    """`tool_choice` naming a function: the output read through `inner`, finished with "stop"
    rather than "tool_calls", as OpenAI finishes a call it was told to make (the grammar makes
    it exactly one call)."""

    name = "named-call"
    calls_finish_reason = "stop"


def read_message(events: Sequence[Event]) -> ParsedMessage:
    """The message a whole output's events spell: valid calls, the rest as content."""
    pieces: list[str | ParsedCall] = []
    names: dict[int, str] = {}
    arguments: dict[int, list[str]] = {}
    for event in events:
        if isinstance(event, Text):
            if pieces and isinstance(pieces[-1], str):
                pieces[-1] += event.text
            else:
                pieces.append(event.text)
        elif isinstance(event, CallStart):
            names[event.index] = event.name
            arguments[event.index] = []
        elif isinstance(event, CallArguments):
            arguments[event.index].append(event.text)
        elif event.is_valid or event.is_cut:
            args = "".join(arguments[event.index])
            pieces.append(ParsedCall(new_call_id(), names[event.index], args))
        elif pieces and isinstance(pieces[-1], str):
            pieces[-1] += event.raw
        else:
            pieces.append(event.raw)
    calls = tuple(p for p in pieces if isinstance(p, ParsedCall))
    content = []
    for i, piece in enumerate(pieces):
        if isinstance(piece, str):
            after_call = i > 0 and isinstance(pieces[i - 1], ParsedCall)
            before_call = i + 1 < len(pieces) and isinstance(pieces[i + 1], ParsedCall)
            piece = piece.lstrip() if after_call else piece
            content.append(piece.rstrip() if before_call else piece)
    text = "".join(content)
    return ParsedMessage(text or None, calls)


@dataclass
class StreamedCall:
    """A call a stream has sent the start of."""

    id: str
    name: str


@dataclass
class CallStream:
    """One streamed output read through a scanner: content with the whitespace around calls
    dropped (trailing whitespace waits until what follows it is known), and call events with
    ids. Call indexes are the scanner's: 0, 1, ... in order."""

    scanner: CallScanner
    calls: list[StreamedCall] = field(default_factory=list)
    _pending_space: str = ""
    _after_call: bool = False

    @property
    def has_calls(self) -> bool:
        return bool(self.calls)

    def feed(self, text: str) -> list[Text | CallStart | CallArguments]:
        return self._read(self.scanner.feed(text), is_last=False)

    def finish(self, is_cut: bool = False) -> list[Text | CallStart | CallArguments]:
        return self._read(self.scanner.finish(is_cut), is_last=True)

    def call_id(self, index: int) -> str:
        return self.calls[index].id

    def _read(self, events: list[Event], is_last: bool) -> list[Text | CallStart | CallArguments]:
        out: list[Text | CallStart | CallArguments] = []
        for event in events:
            if isinstance(event, Text):
                text = self._pending_space + event.text
                if self._after_call:
                    text = text.lstrip()
                    self._after_call = not text
                body = text.rstrip()
                self._pending_space = text[len(body) :]
                if body:
                    out.append(Text(body))
            elif isinstance(event, CallStart):
                self._pending_space = ""
                self.calls.append(StreamedCall(new_call_id(), event.name))
                out.append(event)
            elif isinstance(event, CallArguments):
                out.append(event)
            else:
                self._after_call = True
        if is_last and self._pending_space:
            out.append(Text(self._pending_space))
            self._pending_space = ""
        return out


class FirstCallStream(CallStream):
    """A CallStream that sends only the output's first call (FirstCallParser)."""

    def _read(self, events: list[Event], is_last: bool) -> list[Text | CallStart | CallArguments]:
        read = super()._read(events, is_last)
        return [e for e in read if isinstance(e, Text) or e.index == 0]
