"""Tool calling end to end through the official `openai` client, on a tiny random-weight chat
model (SmolLM2's vocabulary) whose chat template renders tools in the hermes format (the tests'
own ChatML template, tests/templates/chatml_tools.jinja), so the server picks the hermes parser.

A random model never writes a tool call by itself: with tool_choice "required" or a named
function at temperature 1, only the grammar can make every choice a call whose arguments match
the function's schema. A named function is exactly one call, finished with "stop"; "required"
is one or more calls (one without parallel calls), finished with "tool_calls"; a reply that
max_tokens cut, anywhere in a call's markup, has no content. Seeded replies read the same whole
and streamed; the server speculates (the grammar drafts the forced markup). Streamed calls
arrive as OpenAI's fragments and add up to what the non-streamed reply holds; "none" does not
render the tools; history with calls and results renders; bad tool requests are 400s naming the
param; nothing is left running.
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
STATS = "speculative_decoding_stats"


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


def _replies(client: openai.OpenAI, schemas, n: int, **fields: Any) -> list[dict[str, Any]]:
    """Each choice of one seeded request, whole and streamed: its content ("" for none), calls,
    finish reason and (whole) the draft tokens speculation got accepted. The seed makes both
    sample the same output, so both must read the same (the calls' ids aside)."""
    common: dict[str, Any] = dict(
        model=MODEL, messages=MESSAGES, tools=TOOLS, temperature=1.0, n=n, **fields
    )
    stats = {"speculation": {"return_stats": True}}
    reply = client.chat.completions.create(**common, extra_body=stats)
    body = assert_valid(
        schemas, "CreateChatCompletionResponse", reply.model_dump(mode="json", exclude_unset=True)
    )
    whole = []
    for choice in body["choices"]:
        message = choice["message"]
        assert message["content"] != "", choice  # no content is null
        calls = message.get("tool_calls") or []
        whole.append(
            {
                "content": message["content"] or "",
                "calls": calls,
                "finish_reason": choice["finish_reason"],
                "num_accepted": choice[STATS]["num_accepted_draft_tokens"],
            }
        )
    streamed = _streamed(client.chat.completions.create(**common, stream=True), n, schemas)

    def spelled(choice: dict[str, Any]) -> tuple[Any, ...]:
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in choice["calls"]]
        return choice["content"], calls, choice["finish_reason"]

    assert [spelled(c) for c in streamed] == [spelled(c) for c in whole]
    return whole


def _check_forced(choice: dict[str, Any], names: set[str]) -> list[dict[str, Any]]:
    """A choice of a forced call ("required" or a named function): calls and no content, not
    even markup. A choice cut by max_tokens may end inside a call: that last call keeps the
    arguments written so far; every other call is whole. The whole calls, returned."""
    assert choice["content"] == "", choice
    calls = list(choice["calls"])
    assert choice["finish_reason"] in ("stop", "tool_calls", "length"), choice
    if choice["finish_reason"] == "length" and calls:
        last = calls[-1]["function"]
        try:
            jsonschema.validate(json.loads(last["arguments"]), SCHEMAS[last["name"]])
        except ValueError:  # not JSON yet: a call cut short
            assert last["name"] in names and last["arguments"].startswith("{"), choice
            assert "</tool_call>" not in last["arguments"], choice
            calls.pop()
    if calls:
        _check_calls(calls, names)
    return calls


def _cut_at(choice: dict[str, Any], whole: list[dict[str, Any]]) -> str | None:
    """Where max_tokens cut a forced choice: before its first call's name was read, inside a
    call, or after a whole call (None: not cut)."""
    if choice["finish_reason"] != "length":
        return None
    if not choice["calls"]:
        return "before a call"
    return "in a call" if len(whole) < len(choice["calls"]) else "after a call"


NAMED = {"type": "function", "function": {"name": "get_weather"}}
# max_tokens per seed: room for a few calls, and cuts at a call's tag, header and arguments.
LONG = 160
CUTS = [LONG, LONG, LONG, LONG, 4, 9, 16, 24, 34]


@pytest.mark.parametrize("parallel", [None, True, False], ids=["default", "parallel", "single"])
def test_a_named_function_is_exactly_one_call_of_it(live, schemas, parallel) -> None:
    """A named function is called once whatever parallel_tool_calls says: after the call the
    grammar allows only the end. The finish reason is OpenAI's for a forced function: "stop"."""
    client = openai_client(live)
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    cuts, num_accepted = set(), 0
    for seed, max_tokens in enumerate(CUTS):
        choices = _replies(
            client, schemas, 3, tool_choice=NAMED, seed=seed, max_tokens=max_tokens, **extra
        )
        for choice in choices:
            whole = _check_forced(choice, {"get_weather"})
            if choice["finish_reason"] == "length":
                assert len(choice["calls"]) <= 1 and max_tokens < LONG, choice
            else:
                assert choice["finish_reason"] == "stop", choice
                assert len(whole) == len(choice["calls"]) == 1, choice
            cuts.add(_cut_at(choice, whole))
            num_accepted += choice["num_accepted"]
    assert {"before a call", "in a call"} <= cuts  # the small max_tokens cut where they should
    assert num_accepted > 0  # speculation drafted (the grammar's forced markup and keys)
    assert wait_idle(live) == IDLE


@pytest.mark.parametrize("parallel", [None, True, False], ids=["default", "parallel", "single"])
def test_required_is_one_or_more_calls_and_one_without_parallel_calls(
    live, schemas, parallel
) -> None:
    """ "required": one or more calls, the model free to stop after any of them (exactly one with
    `parallel_tool_calls: false`); a reply cut by max_tokens, also inside a call or its markup,
    has calls and no content."""
    client = openai_client(live)
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    counts, reasons, cuts, num_accepted = [], [], set(), 0
    for seed, max_tokens in enumerate(CUTS):
        choices = _replies(
            client, schemas, 3, tool_choice="required", seed=seed, max_tokens=max_tokens, **extra
        )
        for choice in choices:
            whole = _check_forced(choice, set(SCHEMAS))
            if parallel is False:
                assert len(choice["calls"]) <= 1, choice
            if choice["finish_reason"] != "length":
                assert choice["finish_reason"] == "tool_calls" and whole, choice
            if max_tokens == LONG:
                counts.append(len(choice["calls"]))
                reasons.append(choice["finish_reason"])
            cuts.add(_cut_at(choice, whole))
            num_accepted += choice["num_accepted"]
    assert {"before a call", "in a call"} <= cuts and num_accepted > 0
    if parallel is False:
        assert set(counts) == {1} and set(reasons) == {"tool_calls"}
    else:  # more calls may follow one, and the model may stop after any
        assert max(counts) > 1 and "tool_calls" in reasons, (counts, reasons)
    assert wait_idle(live) == IDLE


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
