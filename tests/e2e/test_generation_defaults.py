"""A model's generation_config.json sampling defaults over HTTP: the tiny chat model with
`temperature: 0` in its file samples greedily when a request gives no temperature, on both
endpoints; an explicit temperature wins; `generation_config: none` ignores the file; and a file
whose values no request could ask for stops the model from being served."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.models.generation_defaults import GenerationDefaults
from server.app import create_app
from tests.e2e.conftest import LiveServer, build_chat_model, live_server, tiny_settings
from tests.e2e.server_helpers import HELLO

MODEL = "tiny-greedy"
NUM_TOKENS = 12
SEED = 7


def _chat_model_with(directory: Path, **sampling: Any) -> Path:
    """The tiny chat model, its generation_config.json (eos ids kept) given `sampling`."""
    path = build_chat_model(directory, hidden_size=32, intermediate_size=64)
    config_file = path / "generation_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **sampling}))
    return path


@pytest.fixture(scope="module")
def greedy_model(tmp_path_factory) -> Path:
    return _chat_model_with(tmp_path_factory.mktemp("greedy-model"), temperature=0.0)


@pytest.fixture(scope="module")
def auto(greedy_model: Path) -> Iterator[LiveServer]:
    with live_server(create_app(tiny_settings(greedy_model, MODEL))) as live:
        yield live


def _generate(live: LiveServer, endpoint: str, **fields: Any) -> list[str]:
    """Each choice's text for HELLO (chat) or its first message's text (completions), always
    NUM_TOKENS tokens long."""
    body: dict[str, Any] = {"model": MODEL, "max_tokens": NUM_TOKENS, "ignore_eos": True}
    if endpoint == "chat":
        body["messages"] = HELLO
    else:
        body["prompt"] = HELLO[0]["content"]
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    response = httpx.post(f"{live.base_url}{path}", json={**body, **fields}, timeout=60)
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    return [c["message"]["content"] if endpoint == "chat" else c["text"] for c in choices]


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_no_temperature_takes_the_models_greedy_default(auto, endpoint):
    greedy = _generate(auto, endpoint, temperature=0)
    # Unseeded requests and n=2 choices, all identical: nothing here was sampled.
    assert _generate(auto, endpoint) == greedy
    assert _generate(auto, endpoint, temperature=None) == greedy  # null is left out
    assert _generate(auto, endpoint, n=2) == greedy * 2
    assert auto.serving.generation_defaults == GenerationDefaults(temperature=0.0)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_an_explicit_temperature_wins(auto, endpoint):
    greedy = _generate(auto, endpoint, temperature=0)
    sampled = _generate(auto, endpoint, temperature=1.0, seed=SEED)
    assert sampled != greedy
    assert _generate(auto, endpoint, temperature=1.0, seed=SEED) == sampled  # seeded: repeatable


def test_generation_config_none_ignores_the_file(greedy_model):
    settings = tiny_settings(greedy_model, MODEL, generation_config="none")
    with live_server(create_app(settings)) as live:
        assert live.serving.generation_defaults == GenerationDefaults()
        # OpenAI's default temperature, 1: the same draw as an explicit 1 with the same seed.
        sampled = _generate(live, "chat", seed=SEED)
        assert sampled == _generate(live, "chat", temperature=1.0, seed=SEED)
        assert sampled != _generate(live, "chat", temperature=0)


def test_a_file_no_request_could_ask_for_is_not_served(tmp_path):
    path = _chat_model_with(tmp_path, temperature=5.0)
    with live_server(create_app(tiny_settings(path, MODEL)), wait=False) as live:
        deadline = time.monotonic() + 60
        while httpx.get(f"{live.base_url}/health").json()["status"] == "loading":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        health = httpx.get(f"{live.base_url}/health")
        assert (health.status_code, health.json()) == (503, {"status": "failed"})
        error = live.state.lifecycle.load_error
        assert isinstance(error, ValueError) and "temperature must be in [0, 2]" in str(error)


def test_the_offline_api_takes_the_model_defaults_too(tmp_path):
    """`LLM.generate` without sampling params samples with the file's defaults (as vLLM's does):
    temperature 0 and top_k 5 here, so the output is the greedy one; explicit params win."""
    from engine import LLM, SamplingParams

    path = _chat_model_with(tmp_path / "m", temperature=0.0, top_k=5)
    llm = LLM(str(path), dtype="float32", max_model_len=256)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.top_p) == (0.0, 5, 1.0)
    greedy = SamplingParams(temperature=0.0, max_tokens=defaults.max_tokens)
    (by_default,) = llm.generate("Hello there")
    (explicit,) = llm.generate("Hello there", greedy)
    assert by_default.outputs[0].token_ids == explicit.outputs[0].token_ids
    sampled = [
        llm.generate("Hello there", SamplingParams(temperature=1.0, seed=s, max_tokens=8))[0]
        for s in range(4)
    ]
    assert len({tuple(o.outputs[0].token_ids) for o in sampled}) > 1  # explicit params win
