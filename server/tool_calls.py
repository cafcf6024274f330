"""Tool calling for one chat request: what the prompt shows, what the output must match, and how
the reply is read back.

- `tool_choice` "none" (the default without tools): the tools are NOT rendered into the prompt
  and the output is plain content, as if the request had none. A model that cannot see the tools
  has no reason to write calls, and one that wrote some anyway would have them returned as text.
- "auto" (the default with tools): the tools are rendered, the model chooses, and its output is
  parsed; no grammar.
- "required" or a named function: rendered, parsed, and constrained by the parser's structural
  tag, so the output IS calls whose arguments match the function's `parameters` schema:
  "required" one or more (the model may stop after any), exactly one with
  `parallel_tool_calls: false`; a named function exactly one call of it, whatever
  `parallel_tool_calls` says, as OpenAI, vLLM and SGLang answer it. After the last call allowed
  the grammar allows only the end, so the model stops there. With "auto",
  `parallel_tool_calls: false` is kept by the reading instead: the model's first call is
  returned, whole and streamed, and any later ones are dropped (`FirstCallParser`). A JSON
  `response_format` is a constraint too, so it cannot go with "required" or a named function
  (a 400).

The finish reason, when a choice's output holds calls and the model stopped by itself, is
"tool_calls" - but "stop" for a named function (`NamedCallParser`): OpenAI's API answers a
forced named call so, streamed and not, while "auto" and "required" give "tool_calls" (measured
against api.openai.com in vLLM's PR 25054, which aligned vLLM with it; the spec's enum allows
both). An output cut by max_tokens keeps "length", and is read as `base` says of a cut: the
calls before the cut whole, the one it falls in (once its name is read) a call with the
arguments written so far, and no markup in the content - the same whole and streamed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from engine.structured.spec import StructuredOutput
from server.errors import invalid_request
from server.protocol import ChatCompletionRequest
from server.response_bodies import (
    ChatCompletionDelta,
    ChatCompletionMessage,
    FinishReason,
    FunctionCall,
    FunctionCallChunk,
    ToolCall,
    ToolCallChunk,
)
from server.tool_parsers import ToolParser, select_parser
from server.tool_parsers.base import (
    CallArguments,
    CallStart,
    CallStream,
    FirstCallParser,
    FunctionSpec,
    NamedCallParser,
    Text,
)

logger = logging.getLogger(__name__)


def model_tool_parser(
    setting: str, chat_template: object, model_type: str | None
) -> ToolParser | None:
    """The parser for the served model under the `tool_parser` setting ("auto": from its
    tokenizer's `chat_template`, else its `model_type`)."""
    if isinstance(chat_template, dict):  # named templates: any of them may show the format
        chat_template = "\n".join(str(t) for t in chat_template.values())
    template = chat_template if isinstance(chat_template, str) else None
    parser = select_parser(setting, template, model_type)
    logger.info("tool calls: %s", f"the {parser.name} format" if parser else "not available")
    return parser


@dataclass(frozen=True)
class ToolUse:
    """How one chat request uses its tools: what the chat template renders (None: no tools),
    the parser that reads the output (None: it is all content), and the constraint the output
    must match (None: the model is free)."""

    template_tools: list[dict[str, Any]] | None = None
    parser: ToolParser | None = None
    structured: StructuredOutput | None = None


NO_TOOLS = ToolUse()


def tool_use(req: ChatCompletionRequest, parser: ToolParser | None) -> ToolUse:
    """The request's tool use under the server's parser. Raises a 400 (param `tools`) when the
    request wants calls and the server has no parser for its model, and (param `tool_choice`)
    when it forces calls and a JSON response_format at once."""
    tools = req.tools or []
    choice = req.tool_choice or ("auto" if tools else "none")
    if not tools or choice == "none":
        return NO_TOOLS
    if parser is None:
        message = (
            "tool calls are not available for this model: its chat template shows no known "
            "tool-call format (start the server with --tool-parser to name one)."
        )
        raise invalid_request(message, "tools", "unsupported_value")
    name = choice if isinstance(choice, str) else choice.function.name
    functions = [FunctionSpec(t.function.name, t.function.parameters_schema()) for t in tools]
    structured = parser.structural_tag(functions, name, req.parallel_tool_calls is not False)
    if structured is not None and req.response_format and req.response_format.structured():
        # One output, one grammar: it cannot be both a tool call and a JSON reply.
        message = (
            "tool_choice 'required' or a named function cannot be combined with a JSON "
            "response_format: both constrain the same output"
        )
        raise invalid_request(message, "tool_choice")
    template_tools = [{"type": "function", "function": t.function.for_template()} for t in tools]
    if structured is None and req.parallel_tool_calls is False:
        parser = FirstCallParser(parser)
    elif name not in ("auto", "required"):  # a named function
        parser = NamedCallParser(parser)
    return ToolUse(template_tools, parser, structured)


def with_calls(reason: FinishReason, has_calls: bool, parser: ToolParser) -> FinishReason:
    """OpenAI's finish reason for a choice read through `parser`: the parser's for one that
    called tools and stopped by itself, else the engine's."""
    return parser.calls_finish_reason if has_calls and reason == "stop" else reason


def reply_message(
    text: str, parser: ToolParser | None, is_cut: bool = False
) -> ChatCompletionMessage:
    """A finished choice's message: the text read through the parser, or all content.
    `is_cut`: max_tokens ended the output (a call it cut stays a call, markup is dropped)."""
    if parser is None:
        return ChatCompletionMessage(content=text)
    parsed = parser.parse(text, is_cut)
    calls = [
        ToolCall(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments))
        for call in parsed.calls
    ]
    return ChatCompletionMessage(content=parsed.content, tool_calls=calls or None)


@dataclass
class ToolDeltas:
    """One streamed choice's text read through a parser into chunk deltas, in order: content,
    a call's first fragment (index, id, type, name, empty arguments), its arguments pieces."""

    parser: ToolParser
    _stream: CallStream = field(init=False)
    _is_done: bool = False

    def __post_init__(self) -> None:
        self._stream = self.parser.stream()

    @property
    def has_calls(self) -> bool:
        return self._stream.has_calls

    def deltas(self, text: str, finish_reason: str | None = None) -> list[ChatCompletionDelta]:
        """The deltas `text` (the step's new text) decides; `finish_reason`: the engine's, once
        the choice finished - nothing is held back any more, and at "length" (max_tokens cut
        the output) a call it cut stays a call and markup held back is dropped."""
        if self._is_done:  # outputs after the finishing one repeat it with no new text
            return []
        events = self._stream.feed(text) if text else []
        if finish_reason is not None:
            events += self._stream.finish(is_cut=finish_reason == "length")
            self._is_done = True
        deltas = []
        for event in events:
            if isinstance(event, Text):
                deltas.append(ChatCompletionDelta(content=event.text))
            elif isinstance(event, CallStart):
                first = ToolCallChunk(
                    index=event.index,
                    id=self._stream.call_id(event.index),
                    type="function",
                    function=FunctionCallChunk(name=event.name, arguments=""),
                )
                deltas.append(ChatCompletionDelta(tool_calls=[first]))
            elif isinstance(event, CallArguments):
                piece = ToolCallChunk(
                    index=event.index, function=FunctionCallChunk(arguments=event.text)
                )
                deltas.append(ChatCompletionDelta(tool_calls=[piece]))
        return deltas
