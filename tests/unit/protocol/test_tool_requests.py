"""Tool calling in chat requests: the bodies the spec allows parse, malformed ones are 400s that
name the offending param, past calls reach the chat template with their arguments as a dict,
and each tool choice renders, parses and constrains as `server/tool_calls.py` says."""

from __future__ import annotations

import json

import pytest

from server import errors
from server.engine_inputs import prompt_of
from server.protocol import ChatCompletionRequest, parse_request
from server.tool_calls import NO_TOOLS, tool_use
from server.tool_parsers import get_parser
from server.tool_parsers.base import FirstCallParser, NamedCallParser
from tests.unit.protocol.helpers import CHAT, DROP, patched_body

USER = {"role": "user", "content": "Weather in Paris?"}
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "d", "parameters": SCHEMA, "strict": True},
}
NOW = {"type": "function", "function": {"name": "now"}}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
HISTORY = [
    USER,
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "Sunny"}]},
]
HERMES = get_parser("hermes")


def chat(**fields) -> ChatCompletionRequest:
    return parse_request(ChatCompletionRequest, patched_body(CHAT, **fields))


def with_call(**function) -> list[dict]:
    call = {**CALL, "function": {**CALL["function"], **function}}
    return [USER, {"role": "assistant", "tool_calls": [call]}]


@pytest.mark.parametrize(
    "fields",
    [
        {"tools": [WEATHER, NOW]},
        {"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False},
        {"tools": [WEATHER, NOW], "tool_choice": {"type": "function", "function": {"name": "now"}}},
        {"tools": [WEATHER], "tool_choice": "none"},
        {"tool_choice": "none"},  # what no tools means anyway
        {"tools": []},
        {"tools": None, "tool_choice": None, "parallel_tool_calls": None},
        {"messages": HISTORY, "tools": [WEATHER]},
        {"messages": [USER, {"role": "assistant", "tool_calls": [CALL]}]},  # content left out
    ],
)
def test_valid_tool_bodies_parse(fields):
    chat(**fields)


F = "tools.0.function"
# (id, fields, param, code)
BAD = [
    ("tools-not-list", {"tools": {"type": "function"}}, "tools", None),
    (
        "tool-custom",
        {"tools": [{"type": "custom", "custom": {}}]},
        "tools.0.type",
        "unsupported_value",
    ),
    ("tool-no-function", {"tools": [{"type": "function"}]}, F, None),
    ("tool-no-name", {"tools": [{"type": "function", "function": {}}]}, f"{F}.name", None),
    (
        "name-space",
        {"tools": [{"type": "function", "function": {"name": "a b"}}]},
        f"{F}.name",
        None,
    ),
    (
        "name-65",
        {"tools": [{"type": "function", "function": {"name": "x" * 65}}]},
        f"{F}.name",
        None,
    ),
    (
        "parameters-list",
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
        f"{F}.parameters",
        None,
    ),
    (
        "strict-str",
        {"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]},
        f"{F}.strict",
        None,
    ),
    ("duplicate-names", {"tools": [WEATHER, NOW, WEATHER]}, "tools", None),
    ("choice-unknown-mode", {"tools": [WEATHER], "tool_choice": "always"}, "tool_choice", None),
    ("choice-number", {"tools": [WEATHER], "tool_choice": 1}, "tool_choice", None),
    (
        "choice-unknown-function",
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "now"}}},
        "tool_choice",
        None,
    ),
    (
        "choice-no-function",
        {"tools": [WEATHER], "tool_choice": {"type": "function"}},
        "tool_choice",
        None,
    ),
    (
        "choice-allowed-tools",
        {"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "allowed_tools": {}}},
        "tool_choice",
        "unsupported_value",
    ),
    ("auto-without-tools", {"tool_choice": "auto"}, "tool_choice", None),
    ("required-without-tools", {"tools": [], "tool_choice": "required"}, "tool_choice", None),
    (
        "parallel-str",
        {"tools": [WEATHER], "parallel_tool_calls": "no"},
        "parallel_tool_calls",
        None,
    ),
    ("functions", {"functions": [{"name": "f"}]}, "functions", "unsupported_parameter"),
    ("function-call", {"function_call": "auto"}, "function_call", "unsupported_parameter"),
    (
        "role-function",
        {"messages": [{"role": "function", "name": "f", "content": "x"}]},
        "messages.0.role",
        "unsupported_value",
    ),
    (
        "tool-without-call-id",
        {"messages": [USER, {"role": "tool", "content": "x"}]},
        "messages.1.tool_call_id",
        None,
    ),
    (
        "tool-without-content",
        {"messages": [USER, {"role": "tool", "tool_call_id": "c"}]},
        "messages.1.content",
        None,
    ),
    (
        "user-with-calls",
        {"messages": [{**USER, "tool_calls": [CALL]}]},
        "messages.0.tool_calls",
        None,
    ),
    (
        "assistant-no-content-no-calls",
        {"messages": [USER, {"role": "assistant", "content": None}]},
        "messages.1.content",
        None,
    ),
    (
        "arguments-not-json",
        {"messages": with_call(arguments='{"city": ')},
        "messages.1.tool_calls.0.function.arguments",
        None,
    ),
    (
        "arguments-not-object",
        {"messages": with_call(arguments="[1]")},
        "messages.1.tool_calls.0.function.arguments",
        None,
    ),
    (
        "arguments-not-string",
        {"messages": with_call(arguments={"city": "Paris"})},
        "messages.1.tool_calls.0.function.arguments",
        None,
    ),
    (
        "call-custom",
        {"messages": [USER, {"role": "assistant", "tool_calls": [{**CALL, "type": "custom"}]}]},
        "messages.1.tool_calls.0.type",
        "unsupported_value",
    ),
]


@pytest.mark.parametrize(("fields", "param", "code"), [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_tool_bodies_are_400_with_param(fields, param, code):
    for body in (patched_body(CHAT, **fields), json.dumps(patched_body(CHAT, **fields))):
        with pytest.raises(errors.OpenAIError) as info:
            parse_request(ChatCompletionRequest, body)
        assert (info.value.status, info.value.param, info.value.code) == (400, param, code)


def test_deprecated_functions_point_to_tools():
    with pytest.raises(errors.OpenAIError, match="deprecated: use tools"):
        chat(functions=[{"name": "f"}])


def test_history_reaches_the_template_with_arguments_as_a_dict():
    messages = prompt_of(chat(messages=HISTORY))
    assert messages[1] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    }
    assert messages[2] == {
        "role": "tool",
        "content": [{"type": "text", "text": "Sunny"}],
        "tool_call_id": "call_1",
    }


def test_tool_choices():
    # none (or no tools): nothing rendered, nothing parsed, nothing constrained.
    assert tool_use(chat(tools=[WEATHER], tool_choice="none"), HERMES) == NO_TOOLS
    assert tool_use(chat(), HERMES) == NO_TOOLS
    assert tool_use(chat(tools=[WEATHER], tool_choice="none"), None) == NO_TOOLS
    # auto (the default with tools): rendered without `strict`, parsed, free.
    auto = tool_use(chat(tools=[WEATHER, NOW]), HERMES)
    assert auto.parser is HERMES and auto.structured is None
    assert auto.template_tools == [
        {
            "type": "function",
            "function": {"name": "get_weather", "description": "d", "parameters": SCHEMA},
        },
        {"type": "function", "function": {"name": "now"}},
    ]
    # required and named: constrained to calls of the offered functions.
    required = tool_use(chat(tools=[WEATHER, NOW], tool_choice="required"), HERMES).structured
    tag = json.loads(required.spec)["format"]
    assert [t["content"]["elements"][1]["json_schema"] for t in tag["tags"]] == [
        SCHEMA,
        {"type": "object", "properties": {}},
    ]
    assert tag["stop_after_first"] is False
    # A named function is one call to it whatever parallel_tool_calls says, finished with "stop".
    for parallel in (False, DROP, True):
        named_use = tool_use(
            chat(
                tools=[WEATHER, NOW],
                tool_choice={"type": "function", "function": {"name": "now"}},
                parallel_tool_calls=parallel,
            ),
            HERMES,
        )
        tag = json.loads(named_use.structured.spec)["format"]
        assert [t["content"]["elements"][0]["value"] for t in tag["tags"]] == [
            '{"name": "now", "arguments": '
        ]
        assert tag["stop_after_first"] is True
        assert isinstance(named_use.parser, NamedCallParser) and named_use.parser.inner is HERMES
    # auto without parallel calls: no grammar, so the reading keeps the first call only.
    single = tool_use(chat(tools=[WEATHER, NOW], parallel_tool_calls=False), HERMES)
    assert single.structured is None and isinstance(single.parser, FirstCallParser)
    assert single.parser.inner is HERMES
    text = '<tool_call>{"name": "now", "arguments": {}}</tool_call>' * 2
    assert len(single.parser.parse(text).calls) == 1 and len(HERMES.parse(text).calls) == 2


def test_tool_calls_need_a_parser():
    with pytest.raises(errors.OpenAIError) as info:
        tool_use(chat(tools=[WEATHER]), None)
    assert (info.value.status, info.value.param) == (400, "tools")


def test_forced_calls_and_a_json_format_conflict():
    json_format = {"type": "json_object"}
    auto = tool_use(chat(tools=[WEATHER], response_format=json_format), HERMES)
    assert auto.parser is HERMES and auto.structured is None  # the format constrains alone
    with pytest.raises(errors.OpenAIError) as info:
        tool_use(chat(tools=[WEATHER], tool_choice="required", response_format=json_format), HERMES)
    assert (info.value.status, info.value.param) == (400, "tool_choice")
