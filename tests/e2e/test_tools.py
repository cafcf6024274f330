"""Tool calling end to end through the official `openai` client, on a tiny random-weight chat
model (SmolLM2's vocabulary) whose chat template renders tools in the hermes format (the tests'
own ChatML template, tests/templates/chatml_tools.jinja), so the server picks the hermes parser.

A random model never writes a tool call by itself: with tool_choice "required" or a named
function at temperature 1, only the grammar can make every choice a call whose arguments match
the function's schema. Streamed calls arrive as OpenAI's fragments and add up to what the
non-streamed reply holds; "none" does not render the tools; history with calls and results
renders; bad tool requests are 400s naming the param; nothing is left running.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from server.app import create_app
from tests.e2e.conftest import (
    IDLE,
    LiveServer,
    build_chat_model,
    live_server,
    tiny_settings,
    wait_idle,
)
from tests.e2e.server_helpers import MODEL as DEFAULT_MODEL
from tests.e2e.server_helpers import openai_client
from tests.openapi_spec import assert_valid

jsonschema = pytest.importorskip("jsonschema")

MODEL = "tiny-tools"
TEMPLATE = Path(__file__).resolve().parents[1] / "templates" / "chatml_tools.jinja"
WEATHER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
TIME_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The forecast for a city.",
            "parameters": WEATHER_SCHEMA,
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME_SCHEMA}},
]
SCHEMAS = {"get_weather": WEATHER_SCHEMA, "get_time": TIME_SCHEMA}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
MAX_TOKENS = 300


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> Iterator[LiveServer]:
    path = build_chat_model(tmp_path_factory.mktemp("tools-model"), seed=41)
    shutil.copy(TEMPLATE, path / "chat_template.jinja")
    settings = tiny_settings(path, MODEL, max_model_len=1024)
    with live_server(create_app(settings)) as server:
        yield server


def _check_calls(calls: list[dict[str, Any]], names: set[str]) -> None:
    """Calls of the offered functions, each with a fresh id and schema-valid arguments."""
    assert calls
    assert len({c["id"] for c in calls}) == len(calls)
    for c in calls:
        assert c["id"].startswith("call_") and c["type"] == "function"
        assert c["function"]["name"] in names
        arguments = json.loads(c["function"]["arguments"])
        jsonschema.validate(arguments, SCHEMAS[c["function"]["name"]])


def _streamed(stream: Any, n: int, schemas: dict[str, Any]) -> list[dict[str, Any]]:
    """Each choice's content, calls (fragments added up by index) and finish reason."""
    choices = [{"content": "", "calls": {}, "finish_reason": None} for _ in range(n)]
    for chunk in stream:
        body = assert_valid(
            schemas,
            "CreateChatCompletionStreamResponse",
            chunk.model_dump(mode="json", exclude_unset=True),
        )
        for c in body["choices"]:
            choice = choices[c["index"]]
            choice["content"] += c["delta"].get("content") or ""
            for fragment in c["delta"].get("tool_calls") or []:
                call = choice["calls"].setdefault(fragment["index"], None)
                if call is None:  # the first fragment names the call
                    assert fragment["function"]["arguments"] == ""
                    call = {
                        "id": fragment["id"],
                        "type": fragment["type"],
                        "function": dict(fragment["function"]),
                    }
                    choice["calls"][fragment["index"]] = call
                else:
                    assert set(fragment) == {"index", "function"}
                    assert set(fragment["function"]) == {"arguments"}
                    call["function"]["arguments"] += fragment["function"]["arguments"]
            choice["finish_reason"] = c["finish_reason"] or choice["finish_reason"]
    for choice in choices:
        choice["calls"] = [choice["calls"][i] for i in sorted(choice["calls"])]
    return choices


def test_required_at_temperature_one_is_a_valid_call_in_every_choice(live, schemas) -> None:
    client = openai_client(live)
    reply = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        temperature=1.0,
        n=3,
        seed=7,
        max_tokens=MAX_TOKENS,
    )
    body = assert_valid(
        schemas, "CreateChatCompletionResponse", reply.model_dump(mode="json", exclude_unset=True)
    )
    for choice in body["choices"]:
        assert choice["finish_reason"] == "tool_calls", choice
        assert choice["message"]["content"] is None
        _check_calls(choice["message"]["tool_calls"], set(SCHEMAS))
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        temperature=1.0,
        n=2,
        seed=8,
        max_tokens=MAX_TOKENS,
        stream=True,
    )
    for choice in _streamed(stream, 2, schemas):
        assert choice["finish_reason"] == "tool_calls" and choice["content"] == ""
        _check_calls(choice["calls"], set(SCHEMAS))
    assert wait_idle(live) == IDLE


def test_a_named_function_without_parallel_calls_is_one_call_of_it(live) -> None:
    client = openai_client(live)
    reply = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        parallel_tool_calls=False,
        temperature=1.0,
        n=2,
        seed=9,
        max_tokens=MAX_TOKENS,
    )
    for choice in reply.choices:
        calls = [c.model_dump() for c in choice.message.tool_calls or []]
        assert len(calls) == 1 and calls[0]["function"]["name"] == "get_time"
        _check_calls(calls, {"get_time"})
        assert choice.finish_reason == "tool_calls"


def test_greedy_calls_stream_as_they_reply(live, schemas) -> None:
    client = openai_client(live)
    common: dict[str, Any] = dict(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        temperature=0.0,
        max_tokens=MAX_TOKENS,
    )
    reply = client.chat.completions.create(**common)
    expected = [
        (c.function.name, c.function.arguments) for c in reply.choices[0].message.tool_calls
    ]
    (choice,) = _streamed(client.chat.completions.create(**common, stream=True), 1, schemas)
    assert [
        (c["function"]["name"], c["function"]["arguments"]) for c in choice["calls"]
    ] == expected


def test_auto_and_none(live) -> None:
    client = openai_client(live)
    common: dict[str, Any] = dict(
        model=MODEL, messages=MESSAGES, temperature=1.0, seed=3, max_tokens=16
    )
    auto = client.chat.completions.create(**common, tools=TOOLS)
    none = client.chat.completions.create(**common, tools=TOOLS, tool_choice="none")
    bare = client.chat.completions.create(**common)
    # "auto" renders the tools into the prompt; "none" renders none, as if there were no tools.
    assert auto.usage.prompt_tokens > none.usage.prompt_tokens == bare.usage.prompt_tokens
    # A random model writes no call by itself: its text comes back as content.
    for reply in (auto, none):
        (choice,) = reply.choices
        assert choice.message.tool_calls is None and choice.message.content
        assert choice.finish_reason in ("stop", "length")


def test_history_with_calls_and_results(live) -> None:
    client = openai_client(live)
    call = {
        "id": "call_abc",
        "type": "function",
        "function": {
            "name": "get_weather",
            "arguments": '{"city": "Paris", "unit": "celsius", "days": 1}',
        },
    }
    history = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_abc", "content": "Sunny, 21 C"},
    ]
    reply = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=4)
    assert reply.usage.prompt_tokens > 60
    bad = {**call, "function": {**call["function"], "arguments": '{"city": '}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL,
            messages=[*MESSAGES, {"role": "assistant", "tool_calls": [bad]}],
            max_tokens=4,
        )
    assert info.value.body["param"] == "messages.1.tool_calls.0.function.arguments"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"not": {"type": "string"}}},
                    }
                ],
                "tool_choice": "required",
            },
            "tools",
        ),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ],
)
def test_bad_tool_requests_are_400s(live, fields, param) -> None:
    client = openai_client(live)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            **{"model": MODEL, "messages": MESSAGES, "tools": TOOLS, **fields}
        )
    assert info.value.body["param"] == param
    assert wait_idle(live) == IDLE


def test_a_model_without_a_tool_format_refuses_calls(server) -> None:
    # The default test server's chat template (SmolLM2's own) shows no tool format.
    client = openai_client(server)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=DEFAULT_MODEL, messages=MESSAGES, tools=TOOLS)
    assert info.value.body["param"] == "tools"
    reply = client.chat.completions.create(
        model=DEFAULT_MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=2
    )
    assert reply.choices[0].message.tool_calls is None
