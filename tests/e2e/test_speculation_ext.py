"""The `speculation` request extension and per-choice `speculative_decoding_stats`, end to end.

Two real uvicorn servers over the tiny random-weight Llama (SmolLM2's tokenizer) with n-gram
drafting in mode "always" (a fixed 4 drafts whenever the lookup finds a match, so the numbers do
not depend on timing): `spec_server` reports stats only to requests that opt in; `stats_server`
reports them on every choice (the `speculation_stats` setting) and streams one token per chunk.
Prompts repeat themselves so that the lookup finds matches and drafts get verified; every test
first checks that drafting did happen, so no assertion holds merely because nothing was drafted.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from server.app import create_app
from server.settings import Settings
from tests.e2e.conftest import IDLE, LiveServer, live_server, wait_idle
from tests.openapi_spec import assert_valid, spec_schemas, to_json_schema, validators

jsonschema = pytest.importorskip("jsonschema")

MODEL = "tiny-spec"
NUM_SPEC_TOKENS = 4
NUMBERS = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16"
REPEAT = "Repeat after me: the cat sat on the mat. the cat sat on the mat."
STATS_KEY = "speculative_decoding_stats"
STATS_FIELDS = {
    "mean_acceptance_length",
    "draft_acceptance_rate",
    "num_spec_steps",
    "num_draft_tokens",
    "num_accepted_draft_tokens",
    "acceptance_histogram",
    "by_method",
}
ASK = {"return_stats": True}


def _settings(model_path: Path, **overrides: Any) -> Settings:
    values: dict[str, Any] = dict(
        model=str(model_path),
        served_model_name=MODEL,
        dtype="float32",
        max_model_len=512,
        block_size=16,
        num_kv_blocks=256,
        max_num_seqs=8,
        max_num_batched_tokens=512,
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": NUM_SPEC_TOKENS,
            "mode": "always",
        },
    )
    values.update(overrides)
    return Settings(**values)


@pytest.fixture(scope="module")
def spec_server(tiny_chat_model) -> Iterator[LiveServer]:
    with live_server(create_app(_settings(tiny_chat_model))) as live:
        yield live


@pytest.fixture(scope="module")
def stats_server(tiny_chat_model) -> Iterator[LiveServer]:
    settings = _settings(tiny_chat_model, speculation_stats=True, stream_one_token_per_chunk=True)
    with live_server(create_app(settings)) as live:
        yield live


@pytest.fixture(scope="module")
def schemas() -> dict[str, Any]:
    found = spec_schemas()
    names = [
        "CreateChatCompletionResponse",
        "CreateChatCompletionStreamResponse",
        "CreateCompletionResponse",
        "ErrorResponse",
    ]
    checks = validators(names, found)
    # The spec shares one schema between completions responses and chunks; a chunk's
    # finish_reason is null until the last one.
    chunk = copy.deepcopy(found["CreateCompletionResponse"])
    chunk["properties"]["choices"]["items"]["properties"]["finish_reason"]["nullable"] = True
    checks["CompletionChunk"] = jsonschema.Draft202012Validator(to_json_schema(chunk, found))
    return checks


def _chat(content: str = REPEAT, **fields: Any) -> dict[str, Any]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}]}
    return {**body, "max_tokens": 96, "temperature": 0, **fields}


def _completion(prompt: Any = NUMBERS, **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 64, "temperature": 0, **fields}


def _path(body: dict[str, Any]) -> str:
    return "/v1/chat/completions" if "messages" in body else "/v1/completions"


def _post(live: LiveServer, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(live.base_url + _path(body), json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def _stream(live: LiveServer, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON chunks of a streamed request (the final "[DONE]" checked and dropped)."""
    body = {**body, "stream": True}
    response = httpx.post(live.base_url + _path(body), json=body, timeout=60)
    assert response.status_code == 200, response.text
    blocks = [b for b in response.text.split("\n\n") if b]
    assert blocks[-1] == "data: [DONE]"
    return [json.loads(b.removeprefix("data: ")) for b in blocks[:-1]]


def _final_stats(chunks: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Each choice's stats from a stream; they may only ride on the chunk with finish_reason."""
    found = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            if choice["finish_reason"] is None:
                assert STATS_KEY not in choice, choice
            else:
                assert choice["index"] not in found
                found[choice["index"]] = choice[STATS_KEY]
    return found


def _check_consistent(stats: dict[str, Any], max_drafts: int = NUM_SPEC_TOKENS) -> None:
    """The stats of one choice agree with each other and with their definitions."""
    assert set(stats) == STATS_FIELDS
    steps, drafts, accepted = (
        stats["num_spec_steps"],
        stats["num_draft_tokens"],
        stats["num_accepted_draft_tokens"],
    )
    hist = stats["acceptance_histogram"]
    assert sum(hist) == steps
    assert sum(a * count for a, count in enumerate(hist)) == accepted
    assert len(hist) <= max_drafts + 1 and (not hist or hist[-1] > 0)
    assert steps <= drafts <= max_drafts * steps and accepted <= drafts
    if steps:
        assert stats["mean_acceptance_length"] == pytest.approx(1 + accepted / steps)
        assert stats["draft_acceptance_rate"] == pytest.approx(accepted / drafts)
    else:
        assert (stats["mean_acceptance_length"], stats["draft_acceptance_rate"]) == (0.0, 0.0)


_SAMPLE = re.compile(r'^(specserve:[a-z_]+)\{model_name="[^"]*"\} (\S+)$', re.MULTILINE)


def _counters(live: LiveServer) -> dict[str, float]:
    text = httpx.get(f"{live.base_url}/metrics", timeout=30).text
    return {name: float(value) for name, value in _SAMPLE.findall(text)}


# --------------------------------------------------------------------------- opt-in


def test_stats_are_absent_unless_asked(spec_server, schemas):
    for body in (_chat(), _chat(speculation={"enabled": True}), _completion(n=2)):
        name = "CreateChatCompletionResponse" if "messages" in body else "CreateCompletionResponse"
        response = assert_valid(schemas, name, _post(spec_server, body))
        assert all(STATS_KEY not in choice for choice in response["choices"])
    for chunk in _stream(spec_server, _chat(max_tokens=16)):
        assert all(STATS_KEY not in choice for choice in chunk["choices"])
    asked = _post(spec_server, _chat(speculation=ASK))
    (choice,) = assert_valid(schemas, "CreateChatCompletionResponse", asked)["choices"]
    _check_consistent(choice[STATS_KEY])
    assert choice[STATS_KEY]["num_spec_steps"] > 0  # the prompt makes the lookup find matches


def test_openai_client_reads_the_extension(spec_server):
    client = openai.OpenAI(base_url=f"{spec_server.base_url}/v1", api_key="x", max_retries=0)
    body = _completion()
    response = client.completions.create(
        model=MODEL,
        prompt=body["prompt"],
        max_tokens=body["max_tokens"],
        temperature=0,
        extra_body={"speculation": ASK},
    )
    stats = response.choices[0].model_extra[STATS_KEY]
    _check_consistent(stats)
    assert stats["num_spec_steps"] > 0 and stats["num_accepted_draft_tokens"] > 0
    assert stats == _post(spec_server, _completion(speculation=ASK))["choices"][0][STATS_KEY]


@pytest.mark.parametrize(
    ("speculation", "param"),
    [
        ({"max_draft_tokens": -1}, "speculation.max_draft_tokens"),
        ({"max_draft_tokens": "2"}, "speculation.max_draft_tokens"),
        ({"enabled": "no"}, "speculation.enabled"),
        ({"return_stats": 1}, "speculation.return_stats"),
        ({"return_stat": True}, "speculation.return_stat"),
        ("off", "speculation"),
    ],
)
def test_bad_speculation_values_are_400(spec_server, schemas, speculation, param):
    for body in (_chat(speculation=speculation), _completion(speculation=speculation)):
        response = httpx.post(spec_server.base_url + _path(body), json=body, timeout=30)
        assert response.status_code == 400
        error = assert_valid(schemas, "ErrorResponse", response.json())["error"]
        assert (error["type"], error["param"]) == ("invalid_request_error", param)


# --------------------------------------------------------------------------- streaming


@pytest.mark.parametrize("make_body", [_chat, _completion], ids=["chat", "completions"])
def test_stream_final_chunk_equals_non_streaming(spec_server, schemas, make_body):
    body = make_body(speculation=ASK)
    full = _post(spec_server, body)
    (full_choice,) = full["choices"]
    chunks = _stream(spec_server, body)
    chunk_schema = "CreateChatCompletionStreamResponse" if "messages" in body else "CompletionChunk"
    for chunk in chunks:
        assert_valid(schemas, chunk_schema, chunk)
    assert _final_stats(chunks) == {0: full_choice[STATS_KEY]}
    assert full_choice[STATS_KEY]["num_spec_steps"] > 0
    _check_consistent(full_choice[STATS_KEY])
    # Same greedy request, same tokens: the streamed text is the full text.
    if "messages" in body:
        streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        assert streamed == full_choice["message"]["content"]
    else:
        assert "".join(c["choices"][0]["text"] for c in chunks) == full_choice["text"]


# --------------------------------------------------------------------------- reconciliation


def test_sums_reconcile_with_the_counters(stats_server, schemas):
    """Every choice reports (server setting); over sequential requests the per-choice sums equal
    the change of the engine's Prometheus counters."""
    before = _counters(stats_server)
    reported: list[dict[str, Any]] = []
    sampled = {"temperature": 1.0, "seed": 7}
    for body in (_completion(), _chat(n=2, **sampled), _completion(prompt=[NUMBERS, REPEAT])):
        name = "CreateChatCompletionResponse" if "messages" in body else "CreateCompletionResponse"
        response = assert_valid(schemas, name, _post(stats_server, body))
        reported += [choice[STATS_KEY] for choice in response["choices"]]
    for body in (_chat(), _completion(prompt=[REPEAT, NUMBERS], n=2, **sampled)):
        chunks = _stream(stats_server, body)
        stats = _final_stats(chunks)
        assert sorted(stats) == list(range(len(stats)))
        reported += list(stats.values())
    after = _counters(stats_server)
    assert len(reported) == 1 + 2 + 2 + 1 + 4
    for stats in reported:
        _check_consistent(stats)
    delta = {name: after[name] - before.get(name, 0.0) for name in after}
    counters = {
        "num_spec_steps": delta["specserve:spec_decode_num_drafts_total"],
        "num_draft_tokens": delta["specserve:spec_decode_num_draft_tokens_total"],
        "num_accepted_draft_tokens": delta["specserve:spec_decode_num_accepted_tokens_total"],
    }
    assert {key: sum(s[key] for s in reported) for key in counters} == counters
    assert counters["num_accepted_draft_tokens"] > 0  # drafts were verified and kept
    assert wait_idle(stats_server) == IDLE


# --------------------------------------------------------------------------- controls


@pytest.mark.parametrize("make_body", [_chat, _completion], ids=["chat", "completions"])
def test_opting_out_never_drafts(spec_server, make_body):
    speculating = _post(spec_server, make_body(speculation=ASK))["choices"][0][STATS_KEY]
    assert speculating["num_spec_steps"] > 0  # the same request drafts when allowed
    for speculation in ({"enabled": False}, {"max_draft_tokens": 0}):
        body = make_body(speculation={**ASK, **speculation})
        stats = _post(spec_server, body)["choices"][0][STATS_KEY]
        assert (stats["num_spec_steps"], stats["num_draft_tokens"]) == (0, 0), speculation
        _check_consistent(stats)


def test_max_draft_tokens_caps_each_step(spec_server):
    body = _completion(prompt=[NUMBERS, REPEAT], max_tokens=96)
    uncapped = [c[STATS_KEY] for c in _post(spec_server, {**body, "speculation": ASK})["choices"]]
    # Without the cap some step drafted (and accepted) more than 2 tokens.
    assert any(s["num_draft_tokens"] > 2 * s["num_spec_steps"] for s in uncapped)
    assert any(len(s["acceptance_histogram"]) > 3 for s in uncapped)
    capped_body = {**body, "speculation": {**ASK, "max_draft_tokens": 2}}
    capped = [c[STATS_KEY] for c in _post(spec_server, capped_body)["choices"]]
    for stats in capped:
        _check_consistent(stats, max_drafts=2)
        assert len(stats["acceptance_histogram"]) <= 3
        assert stats["num_draft_tokens"] <= 2 * stats["num_spec_steps"]
    assert sum(s["num_spec_steps"] for s in capped) > 0
