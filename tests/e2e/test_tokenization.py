"""Requests are templated and tokenised off the event loop and off the engine thread, each
thread with a tokenizer of its own, and the ids are the ones the engine itself would make."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import server.prompt_tokenizer as prompt_tokenizer_module
from engine.text.tokenizer import apply_chat_template
from server.app import create_app
from tests.e2e.conftest import IDLE, LiveServer, live_server, tiny_settings, wait_idle

MODEL = "tiny-chat"
HELLO = [{"role": "user", "content": "Hello there, how are you?"}]


@pytest.fixture(scope="module")
def server(tiny_chat_model: Path) -> Iterator[LiveServer]:
    # Predictions speculate: a text prediction's ids must be the engine's to be accepted. Mode
    # "always": under auto the policy may judge a draft not worth its verify on a loaded host,
    # and this test is about the ids, not the policy.
    settings = tiny_settings(
        tiny_chat_model, MODEL, speculative_config={"method": "prediction", "mode": "always"}
    )
    with live_server(create_app(settings)) as live:
        yield live


def _chat(base_url: str, **extra: Any) -> httpx.Response:
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 4, "temperature": 0, **extra}
    return httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=30)


def test_each_thread_tokenises_with_its_own_tokenizer(server, monkeypatch):
    seen: list[tuple[threading.Thread, Any]] = []
    render = prompt_tokenizer_module.apply_chat_template

    def recording(tokenizer: Any, messages: Any, **kwargs: Any) -> list[int]:
        seen.append((threading.current_thread(), tokenizer))
        return render(tokenizer, messages, **kwargs)

    monkeypatch.setattr(prompt_tokenizer_module, "apply_chat_template", recording)
    assert _chat(server.base_url).status_code == 200
    assert _chat(server.base_url).status_code == 200

    engine_tokenizer, engine_thread = server.call(
        lambda engine: (engine.tokenizer, threading.current_thread())
    )
    (thread, tokenizer), (thread_again, tokenizer_again) = seen
    assert thread is thread_again and tokenizer is tokenizer_again  # one worker, one copy
    assert thread is not server.thread and thread is not engine_thread
    assert tokenizer is not engine_tokenizer
    assert tokenizer is not server.serving.token_decoder.tokenizer  # the loop's token texts
    assert server.serving.token_decoder.tokenizer is not engine_tokenizer
    # The copy renders the same ids as the engine's tokenizer.
    assert render(tokenizer, HELLO) == render(engine_tokenizer, HELLO)


def test_the_loop_serves_while_a_prompt_is_being_tokenised(server, monkeypatch):
    # The tokenisation waits until /health has answered: on the event loop it would hold the
    # loop, /health could not answer and the request would time out.
    health_answered = threading.Event()
    render = prompt_tokenizer_module.apply_chat_template

    def waiting(tokenizer: Any, messages: Any, **kwargs: Any) -> list[int]:
        assert health_answered.wait(20), "/health did not answer during the tokenisation"
        return render(tokenizer, messages, **kwargs)

    monkeypatch.setattr(prompt_tokenizer_module, "apply_chat_template", waiting)
    result: dict[str, httpx.Response] = {}
    chat = threading.Thread(target=lambda: result.update(chat=_chat(server.base_url)))
    chat.start()
    try:
        assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
    finally:
        health_answered.set()
        chat.join(30)
    assert result["chat"].status_code == 200
    assert wait_idle(server) == IDLE


def test_text_prompts_and_predictions_become_the_engines_ids(server):
    tokenizer = server.call(lambda engine: engine.tokenizer)
    text = "def add(a, b):\n    return a + b\n"
    ids = tokenizer.encode(text)

    def complete(prompt: Any) -> dict[str, Any]:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0}
        response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=30)
        assert response.status_code == 200, response.text
        return response.json()

    by_text, by_ids = complete(text), complete(ids)
    assert by_text["usage"]["prompt_tokens"] == len(ids)
    assert by_text["choices"][0]["text"] == by_ids["choices"][0]["text"]
    both = complete([text, text + "#"])
    assert both["choices"][0]["text"] == by_text["choices"][0]["text"]
    assert both["usage"]["prompt_tokens"] == len(ids) + len(tokenizer.encode(text + "#"))

    # A chat prompt's ids: the chat template's, as the engine's own tokenizer renders them.
    chat = _chat(server.base_url, max_tokens=1).json()
    assert chat["usage"]["prompt_tokens"] == len(apply_chat_template(tokenizer, HELLO))
    # A text prediction is tokenised as the engine would: the greedy answer given back as the
    # prediction is accepted as drafts, and the answer is unchanged.
    answer = _chat(server.base_url, max_tokens=12, ignore_eos=True).json()
    text = answer["choices"][0]["message"]["content"]
    predicted = _chat(
        server.base_url,
        max_tokens=12,
        ignore_eos=True,
        prediction={"type": "content", "content": text},
    ).json()
    assert predicted["choices"][0]["message"]["content"] == text
    details = predicted["usage"]["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] > 0
