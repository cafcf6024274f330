"""The HTTP server on the device: a real uvicorn server, the official `openai` client. Requests at
temperature 1 (OpenAI's default: the sampling path, with its per-request generators on the
device) return 200, in parallel and streamed, and /health stays 200 afterwards: the engine loop
survived them."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import openai
import pytest

from server.app import create_app
from server.settings import Settings
from tests.e2e.conftest import IDLE, LiveServer, live_server, wait_idle
from tests.gpu.node import FLASH_BF16, TORCH_FP32, needs_device

pytestmark = [pytest.mark.gpu, needs_device, pytest.mark.gpu_check("HTTP server: temperature 1")]

MODEL = "gpu-node"
HELLO = [{"role": "user", "content": "Hello there, how are you?"}]


@pytest.fixture(scope="module", params=[TORCH_FP32, FLASH_BF16], ids=lambda s: s.id)
def server(request, gpu_chat_model, device) -> Iterator[LiveServer]:
    setup = request.param
    setup.require(device)
    settings = Settings(
        model=str(gpu_chat_model),
        served_model_name=MODEL,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        log_stats_interval=0,
        **setup.engine_kwargs(device),
    )
    with live_server(create_app(settings)) as live:
        yield live


def _client(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.base_url}/v1", api_key="unused", max_retries=0)


def test_temperature_one_requests_leave_the_server_healthy(server):
    # No temperature: the server applies OpenAI's default of 1.
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 16}
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 1

    client = _client(server)
    kw = dict(model=MODEL, messages=HELLO, max_tokens=12, temperature=1.0)
    first = client.chat.completions.create(**kw, seed=7)
    again = client.chat.completions.create(**kw, seed=7)
    assert again.choices[0].message.content == first.choices[0].message.content
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    legacy = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.0, n=2
    )
    assert len(legacy.choices) == 2

    async def in_parallel() -> list[str | None]:
        aclient = openai.AsyncOpenAI(
            base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0
        )
        async with aclient:
            calls = [
                aclient.chat.completions.create(**kw, seed=seed) for seed in (None, 1, 2, None, 7)
            ]
            return [r.choices[0].message.content for r in await asyncio.gather(*calls)]

    texts = asyncio.run(in_parallel())
    assert texts[4] == first.choices[0].message.content  # batching does not change a seeded one

    health = httpx.get(f"{server.base_url}/health", timeout=10)
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    assert wait_idle(server) == IDLE
