"""An EAGLE-3 head in the published format served through the real HTTP server: the official
openai client streams the same greedy text with the head drafting as with speculation off, the
head's drafts show under its name in the response's stats and in /metrics, and streams the
client drops leave the engine idle with no block in use."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from server.app import create_app
from tests.e2e.conftest import IDLE, LiveServer, live_server, tiny_settings, wait_idle
from tests.eagle3_heads import build_tiny_eagle3_head

MODEL = "tiny-eagle3"
MESSAGES = [
    [{"role": "user", "content": "Count with me: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12"}],
    [{"role": "user", "content": "Repeat after me: the cat sat on the mat. the cat sat."}],
    [{"role": "user", "content": "Write a function that adds two numbers."}],
]


@pytest.fixture(scope="module")
def head(tiny_chat_model, tmp_path_factory) -> Path:
    # The tiny chat model has one layer: the head taps its input (the embedding).
    return build_tiny_eagle3_head(
        tmp_path_factory.mktemp("eagle3-head"),
        tiny_chat_model,
        seed=21,
        draft_vocab_size=4096,
        aux_layer_ids=[0],
    )


def _server(model: Path, spec: dict | None) -> Iterator[LiveServer]:
    settings = tiny_settings(model, MODEL, speculative_config=spec)
    with live_server(create_app(settings)) as live:
        yield live


@pytest.fixture(scope="module")
def eagle_server(tiny_chat_model, head) -> Iterator[LiveServer]:
    spec = {
        "method": "eagle3",
        "model": str(head),
        "num_speculative_tokens": 3,
        "mode": "always",
        "draft_min_confidence": 0.0,
    }
    yield from _server(tiny_chat_model, spec)


@pytest.fixture(scope="module")
def expected(tiny_chat_model) -> list[str]:
    """Each conversation's greedy answer from a server without speculation."""
    answers = []
    for live in _server(tiny_chat_model, None):
        client = openai.OpenAI(base_url=f"{live.base_url}/v1", api_key="x", max_retries=0)
        for messages in MESSAGES:
            reply = client.chat.completions.create(
                model=MODEL, messages=messages, temperature=0, max_tokens=48
            )
            answers.append(reply.choices[0].message.content)
    return answers


def test_streamed_greedy_text_equals_speculation_off(eagle_server, expected):
    client = openai.OpenAI(base_url=f"{eagle_server.base_url}/v1", api_key="x", max_retries=0)
    for messages, answer in zip(MESSAGES, expected, strict=True):
        stream = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            temperature=0,
            max_tokens=48,
            stream=True,
            extra_body={"speculation": {"return_stats": True}},
        )
        text, stats = [], None
        for chunk in stream:
            for choice in chunk.choices:
                text.append(choice.delta.content or "")
                stats = getattr(choice, "speculative_decoding_stats", None) or stats
        assert "".join(text) == answer
        assert stats is not None
        by_method = stats["by_method"]
        assert set(by_method) == {"eagle3"}
        assert by_method["eagle3"]["num_draft_tokens"] == stats["num_draft_tokens"] > 0
    assert wait_idle(eagle_server) == IDLE


def test_metrics_count_the_heads_drafts(eagle_server):
    client = openai.OpenAI(base_url=f"{eagle_server.base_url}/v1", api_key="x", max_retries=0)
    client.chat.completions.create(model=MODEL, messages=MESSAGES[0], max_tokens=24)
    text = httpx.get(f"{eagle_server.base_url}/metrics", timeout=10).text
    found = re.search(
        r'^specserve:spec_decode_num_draft_tokens_by_method_total\{[^}]*method="eagle3"[^}]*\} '
        r"(\S+)$",
        text,
        re.M,
    )
    assert found is not None and float(found.group(1)) > 0


def test_dropped_streams_leave_no_block_in_use(eagle_server):
    client = openai.OpenAI(base_url=f"{eagle_server.base_url}/v1", api_key="x", max_retries=0)
    for messages in MESSAGES:
        stream = client.chat.completions.create(
            model=MODEL, messages=messages, temperature=0.8, max_tokens=200, stream=True
        )
        for i, _ in enumerate(stream):
            if i == 5:
                stream.close()  # the client goes away mid-answer
                break
    assert wait_idle(eagle_server) == IDLE
    states = eagle_server.call(lambda engine: len(engine.speculator.chain[0]._states))
    assert states == 0
