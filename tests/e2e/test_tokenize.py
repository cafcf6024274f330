"""POST /tokenize and /detokenize on a real server over the tiny chat model (SmolLM2's tokenizer
and ChatML template), behind an API key: the ids are exactly those the generation endpoints use
(a chat's `usage.prompt_tokens` is the count), the round trip gives back the text, the work runs
on the prompt tokenizer's thread with its own copy, and bad bodies get OpenAI envelopes.
A second server over a checkpoint without a tokenizer answers 400."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import server.prompt_tokenizer as prompt_tokenizer_module
from engine.text.tokenizer import apply_chat_template, encode_text
from server.app import create_app
from tests.conftest import build_tiny_model
from tests.e2e.conftest import IDLE, LiveServer, live_server, tiny_settings, wait_idle
from tests.e2e.server_helpers import API_KEY, HELLO, MAX_MODEL_LEN
from tests.openapi_spec import assert_valid

MODEL = "tiny-tokenize"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
VOCAB = 49152  # SmolLM2's tokenizer: ids 0 to 49151
TEXT = "Hello world, the quick brown fox. <|im_end|>"


@pytest.fixture(scope="module")
def keyed(tiny_chat_model: Path) -> Iterator[LiveServer]:
    settings = tiny_settings(tiny_chat_model, MODEL, api_key=API_KEY)
    with live_server(create_app(settings)) as live:
        yield live


@pytest.fixture()
def http(keyed: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=keyed.base_url, headers=AUTH, timeout=30) as client:
        yield client


def _ok(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    return response.json()


def test_messages_tokenize_to_the_chat_prompt(keyed, http):
    body = _ok(http.post("/tokenize", json={"model": MODEL, "messages": HELLO}))
    want = keyed.call(lambda engine: apply_chat_template(engine.tokenizer, HELLO))
    assert body == {"count": len(want), "max_model_len": MAX_MODEL_LEN, "tokens": want}
    chat = {"model": MODEL, "messages": HELLO, "max_tokens": 1, "temperature": 0}
    usage = _ok(http.post("/v1/chat/completions", json=chat))["usage"]
    assert usage["prompt_tokens"] == body["count"]
    # `model` is optional; without a generation prompt the ids are the same minus its header.
    bare = _ok(http.post("/tokenize", json={"messages": HELLO, "add_generation_prompt": False}))
    assert bare["count"] < body["count"] and want[: bare["count"]] == bare["tokens"]
    # SmolLM2's tokenizer adds no special tokens, so asking for them changes nothing here
    # (tests/unit/test_prompt_tokenizer.py covers one that does).
    special = _ok(http.post("/tokenize", json={"messages": HELLO, "add_special_tokens": True}))
    assert special == body
    assert wait_idle(keyed) == IDLE


def test_a_prompt_tokenizes_as_completions_encode_it(keyed, http):
    body = _ok(http.post("/tokenize", json={"model": MODEL, "prompt": TEXT}))
    want = keyed.call(lambda engine: encode_text(engine.tokenizer, TEXT))
    assert body == {"count": len(want), "max_model_len": MAX_MODEL_LEN, "tokens": want}
    completion = {"model": MODEL, "prompt": TEXT, "max_tokens": 1, "temperature": 0}
    assert _ok(http.post("/v1/completions", json=completion))["usage"]["prompt_tokens"] == len(want)
    # Control tokens written in a text prompt are encoded as the tokens they name, as the
    # completions endpoint encodes them: <|im_end|> is one id.
    assert want[-1] == keyed.call(
        lambda engine: engine.tokenizer.convert_tokens_to_ids("<|im_end|>")
    )
    plain = _ok(http.post("/tokenize", json={"prompt": TEXT, "add_special_tokens": False}))
    assert plain == body  # no special tokens to add with this tokenizer
    assert wait_idle(keyed) == IDLE


def test_round_trips(http):
    ids = _ok(http.post("/tokenize", json={"prompt": TEXT}))["tokens"]
    assert _ok(http.post("/detokenize", json={"model": MODEL, "tokens": ids})) == {"prompt": TEXT}
    # A chat's ids decode to its rendered prompt, control tokens included, which encodes back
    # to the same ids.
    chat_ids = _ok(http.post("/tokenize", json={"messages": HELLO}))["tokens"]
    rendered = _ok(http.post("/detokenize", json={"tokens": chat_ids}))["prompt"]
    assert HELLO[0]["content"] in rendered and rendered.endswith("<|im_start|>assistant\n")
    again = _ok(http.post("/tokenize", json={"prompt": rendered, "add_special_tokens": False}))
    assert again["tokens"] == chat_ids
    # The vocabulary's last id is still an id.
    assert isinstance(_ok(http.post("/detokenize", json={"tokens": [VOCAB - 1]}))["prompt"], str)


def test_the_work_runs_on_the_prompt_tokenizer_thread(keyed, http, monkeypatch):
    seen: list[tuple[str, threading.Thread, Any]] = []
    render, decode = prompt_tokenizer_module.apply_chat_template, prompt_tokenizer_module._decode

    def rendering(tokenizer: Any, *args: Any) -> list[int]:
        seen.append(("render", threading.current_thread(), tokenizer))
        return render(tokenizer, *args)

    def decoding(tokenizer: Any, ids: Any) -> str:
        seen.append(("decode", threading.current_thread(), tokenizer))
        return decode(tokenizer, ids)

    monkeypatch.setattr(prompt_tokenizer_module, "apply_chat_template", rendering)
    monkeypatch.setattr(prompt_tokenizer_module, "_decode", decoding)
    ids = _ok(http.post("/tokenize", json={"messages": HELLO}))["tokens"]
    _ok(http.post("/detokenize", json={"tokens": ids}))
    engine_tokenizer, engine_thread = keyed.call(
        lambda engine: (engine.tokenizer, threading.current_thread())
    )
    prompt_tokenizer = keyed.serving.prompt_tokenizer._tokenizer
    assert [name for name, _, _ in seen] == ["render", "decode"]
    for _, thread, tokenizer in seen:
        assert thread is not keyed.thread and thread is not engine_thread  # not the loop's
        assert tokenizer is prompt_tokenizer and tokenizer is not engine_tokenizer
    assert seen[0][1] is seen[1][1]


def test_an_api_key_is_required(keyed):
    for path, body in [("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})]:
        missing = httpx.post(f"{keyed.base_url}{path}", json=body, timeout=30)
        wrong = httpx.post(
            f"{keyed.base_url}{path}", json=body, headers={"Authorization": "Bearer no"}, timeout=30
        )
        for response in (missing, wrong):
            assert response.status_code == 401
            assert response.json()["error"]["code"] == "invalid_api_key"


def _bad_bodies() -> list[tuple[str, str, Any, int, str | None]]:
    """(name, path, body, status, the error's param)."""
    tok, detok = "/tokenize", "/detokenize"
    return [
        ("neither", tok, {"model": MODEL}, 400, "prompt"),
        ("both", tok, {"prompt": "hi", "messages": HELLO}, 400, "messages"),
        ("empty-prompt", tok, {"prompt": ""}, 400, "prompt"),
        ("prompt-not-text", tok, {"prompt": 5}, 400, "prompt"),
        ("prompt-ids", tok, {"prompt": [1, 2]}, 400, "prompt"),
        ("no-messages", tok, {"messages": []}, 400, "messages"),
        (
            "tool-without-call-id",
            tok,
            {"messages": [{"role": "tool", "content": "x"}]},
            400,
            "messages.0.tool_call_id",
        ),
        ("no-content", tok, {"messages": [{"role": "user"}]}, 400, "messages.0.content"),
        (
            "generation-prompt-on-text",
            tok,
            {"prompt": "hi", "add_generation_prompt": True},
            400,
            "add_generation_prompt",
        ),
        (
            "special-not-bool",
            tok,
            {"prompt": "hi", "add_special_tokens": "yes"},
            400,
            "add_special_tokens",
        ),
        (
            "unknown-field",
            tok,
            {"prompt": "hi", "return_token_strs": True},
            400,
            "return_token_strs",
        ),
        ("tokenize-other-model", tok, {"model": "gpt-4o", "prompt": "hi"}, 404, "model"),
        ("not-an-object", tok, [1, 2], 400, None),
        ("no-tokens", detok, {"tokens": []}, 400, "tokens"),
        ("tokens-missing", detok, {"model": MODEL}, 400, "tokens"),
        ("negative-id", detok, {"tokens": [5, -1]}, 400, "tokens.1"),
        ("id-past-vocabulary", detok, {"tokens": [5, VOCAB]}, 400, "tokens.1"),
        ("id-as-string", detok, {"tokens": ["5"]}, 400, "tokens.0"),
        ("id-as-float", detok, {"tokens": [5.0]}, 400, "tokens.0"),
        ("id-as-bool", detok, {"tokens": [True]}, 400, "tokens.0"),
        ("text-not-ids", detok, {"tokens": "hello"}, 400, "tokens"),
        ("detokenize-other-model", detok, {"model": "gpt-4o", "tokens": [5]}, 404, "model"),
    ]


@pytest.mark.parametrize("name,path,body,status,param", _bad_bodies())
def test_bad_bodies_get_an_envelope(http, schemas, name, path, body, status, param):
    response = http.post(path, json=body)
    assert response.status_code == status, response.text
    error = assert_valid(schemas, "ErrorResponse", response.json())["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param


def test_malformed_json_and_content_type(http):
    broken = http.post(
        "/tokenize", content=b'{"prompt": ', headers={"Content-Type": "application/json"}
    )
    assert broken.status_code == 400 and "not valid JSON" in broken.json()["error"]["message"]
    text = http.post(
        "/detokenize", content=b'{"tokens": [1]}', headers={"Content-Type": "text/plain"}
    )
    assert text.status_code == 400 and text.json()["error"]["code"] == "invalid_content_type"


@pytest.fixture(scope="module")
def bare(tmp_path_factory) -> Iterator[LiveServer]:
    """A tiny Llama saved without any tokenizer file: prompts must be token ids."""
    path = build_tiny_model(tmp_path_factory.mktemp("no-tokenizer"), "llama")
    with live_server(create_app(tiny_settings(path, "tiny-bare"))) as live:
        yield live


def test_a_model_without_a_tokenizer_answers_400(bare):
    for path, body in [("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})]:
        response = httpx.post(f"{bare.base_url}{path}", json=body, timeout=30)
        assert response.status_code == 400, response.text
        assert "no tokenizer" in response.json()["error"]["message"]
