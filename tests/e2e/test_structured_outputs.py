"""`response_format` end to end through the official `openai` client: a tiny random-weight chat
model (SmolLM2's vocabulary), where only the grammar can make the output valid JSON.

One server per speculation setup (off, the grammar's own drafts, n-gram, a draft model, an EAGLE-3
head); on each, json_schema requests at temperature 1 with n > 1, streamed and not, give
schema-valid JSON in every choice; greedy output is the same text on every server; json_object gives an object; the
completions endpoint takes response_format too; a schema the grammar library cannot use, or a
malformed response_format, is a 400 naming it, and nothing is left running.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
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
from tests.eagle3_heads import build_tiny_eagle3_head

jsonschema = pytest.importorskip("jsonschema")

MODEL = "tiny-structured"
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "array", "items": {"enum": [1, 2, 3]}, "minItems": 1, "maxItems": 3},
        "alerts": {"type": "boolean"},
    },
    "required": ["city", "unit", "days", "alerts"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": SCHEMA}}
MESSAGES = [{"role": "user", "content": "The forecast for Paris, as JSON."}]
SETUPS: dict[str, dict[str, Any] | None] = {
    "off": {"method": "ngram", "mode": "off"},
    "grammar": None,
    "ngram": {
        "method": "ngram",
        "mode": "always",
        "num_speculative_tokens": 4,
        "prompt_lookup_min": 1,
    },
    "draft_model": {"method": "draft_model", "mode": "always", "num_speculative_tokens": 3},
    # A head over a quarter of the vocabulary: where the grammar allows only tokens outside it,
    # the head has nothing to draft and drafts nothing.
    "eagle3": {
        "method": "eagle3",
        "mode": "always",
        "num_speculative_tokens": 3,
        "draft_min_confidence": 0.0,
    },
}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    target = build_chat_model(tmp_path_factory.mktemp("structured-target"), seed=31)
    draft = build_chat_model(tmp_path_factory.mktemp("structured-draft"), seed=32)
    return target, draft


@pytest.fixture(scope="module", params=list(SETUPS))
def live(request, models) -> Iterator[tuple[str, LiveServer]]:
    target, draft = models
    spec = SETUPS[request.param]
    if spec is not None and spec["method"] == "draft_model":
        spec = {**spec, "model": str(draft)}
    if spec is not None and spec["method"] == "eagle3":
        head = build_tiny_eagle3_head(
            target.parent / "structured-head",
            target,
            seed=33,
            draft_vocab_size=12288,
            aux_layer_ids=[0],
        )
        spec = {**spec, "model": str(head)}
    settings = tiny_settings(target, MODEL, speculative_config=spec)
    with live_server(create_app(settings)) as server:
        yield request.param, server


_GREEDY: dict[str, str] = {}  # setup -> greedy text, compared across the module's servers


def test_json_schema_at_temperature_one_is_valid_in_every_choice(live) -> None:
    name, server = live
    client = openai_client(server)
    reply = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        response_format=FORMAT,
        temperature=1.0,
        n=3,
        seed=4,
        max_tokens=120,
    )
    assert len(reply.choices) == 3
    for choice in reply.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        response_format=FORMAT,
        temperature=1.0,
        n=2,
        seed=5,
        max_tokens=120,
        stream=True,
    )
    texts, reasons = ["", ""], [None, None]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            reasons[c.index] = c.finish_reason or reasons[c.index]
    assert reasons == ["stop", "stop"]
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert wait_idle(server) == IDLE


def test_greedy_text_is_the_same_with_every_speculation_setup(live) -> None:
    name, server = live
    reply = openai_client(server).chat.completions.create(
        model=MODEL, messages=MESSAGES, response_format=FORMAT, temperature=0, max_tokens=120
    )
    text = reply.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)
    _GREEDY[name] = text
    assert len(set(_GREEDY.values())) == 1, _GREEDY


def test_json_object_and_completions(live) -> None:
    name, server = live
    client = openai_client(server)
    reply = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=150,
    )
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
    else:  # a free object may run to max_tokens: then it is still an object's prefix
        assert reply.choices[0].message.content.startswith("{")
    completion = client.completions.create(
        model=MODEL,
        prompt="Forecast:",
        max_tokens=120,
        temperature=1.0,
        seed=9,
        extra_body={"response_format": FORMAT},
    )
    assert completion.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(completion.choices[0].text), SCHEMA)


@pytest.mark.parametrize(
    "response_format, needle",
    [
        (
            {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(?<=a)b"}},
            },
            "ookbehind",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}},
            "strin",
        ),
        ({"type": "json_schema"}, "json_schema"),
        ({"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {}}}, "name"),
        ({"type": "yaml"}, "type"),
    ],
)
def test_a_format_the_server_cannot_use_is_a_400_naming_it(
    server: LiveServer, response_format: dict[str, Any], needle: str
) -> None:
    """On the default server (tests/e2e/conftest.py), whatever its speculation."""
    body = {"model": DEFAULT_MODEL, "messages": MESSAGES, "response_format": response_format}
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"].startswith("response_format")
    assert needle in error["message"]
    with pytest.raises(openai.BadRequestError):
        openai_client(server).chat.completions.create(
            model=DEFAULT_MODEL, messages=MESSAGES, response_format=response_format
        )
    assert wait_idle(server) == IDLE
