"""Tool-call parsers, registered by name: how a model family writes tool calls, read back into
OpenAI's shape (see `base.ToolParser`).

The `tool_parser` setting names one; "auto" (the default) picks the parser whose markers the
model's chat template contains, else the one its model type is known to use, else none; "none"
turns tool calling off. Without a parser a request may still carry tools with
`tool_choice: "none"`, but any other choice is a 400.
"""

from __future__ import annotations

from collections.abc import Callable

from server.tool_parsers.base import ParsedCall, ParsedMessage, ToolParser

AUTO = "auto"
NONE = "none"


def _hermes() -> ToolParser:
    from server.tool_parsers.hermes import HermesParser

    return HermesParser()


_PARSERS: dict[str, Callable[[], ToolParser]] = {"hermes": _hermes}


def names() -> tuple[str, ...]:
    """The registered parsers' names."""
    return tuple(_PARSERS)


def choices() -> tuple[str, ...]:
    """Every value the `tool_parser` setting takes."""
    return (AUTO, NONE, *_PARSERS)


def get_parser(name: str) -> ToolParser:
    try:
        return _PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool parser {name!r}; choose one of {choices()}.") from None


def select_parser(
    setting: str, chat_template: str | None, model_type: str | None
) -> ToolParser | None:
    """The parser a server uses for its model: the one `setting` names, or, for "auto", the
    one the chat template or (failing that) the model type points to; None: no tool calls."""
    if setting == NONE:
        return None
    if setting != AUTO:
        return get_parser(setting)
    parsers = [factory() for factory in _PARSERS.values()]
    for parser in parsers:
        if chat_template and any(marker in chat_template for marker in parser.template_markers):
            return parser
    for parser in parsers:
        if model_type in parser.model_types:
            return parser
    return None


__all__ = [
    "ParsedCall",
    "ParsedMessage",
    "ToolParser",
    "choices",
    "get_parser",
    "names",
    "select_parser",
]
