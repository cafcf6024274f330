"""What the test_server_* modules share: the names their servers serve, the settings they run
with, clients pointed at a live server, and the pieces of a request body and an SSE response."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import openai

from server.settings import Settings

if TYPE_CHECKING:  # conftest imports this module: a runtime import back would be circular
    from tests.e2e.conftest import LiveServer

MODEL = "tiny-chat"
GUARDED = "tiny-guarded"
API_KEY = "sk-test-0123456789"
MAX_MODEL_LEN = 512
MAX_BODY = 256 * 1024
HELLO = [{"role": "user", "content": "Hello there, how are you?"}]
# The OpenAPI components whose validators the `schemas` fixture builds.
SCHEMA_NAMES = [
    "CreateChatCompletionResponse",
    "CreateChatCompletionStreamResponse",
    "CreateCompletionResponse",
    "ListModelsResponse",
    "Model",
    "ErrorResponse",
]


def server_settings(model_path: Path, **overrides: Any) -> Settings:
    """The tiny chat model served as MODEL, with a body limit and one CORS origin allowed;
    `overrides` replace or add fields."""
    values: dict[str, Any] = dict(
        model=str(model_path),
        served_model_name=MODEL,
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        block_size=16,
        num_kv_blocks=256,
        max_num_seqs=16,
        max_num_batched_tokens=512,
        max_body_bytes=MAX_BODY,
        cors_allow_origins=["http://allowed.example"],
    )
    values.update(overrides)
    return Settings(**values)


def openai_client(live: LiveServer, key: str = "unused", **kw: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.base_url}/v1", api_key=key, max_retries=0, **kw)


def async_openai_client(live: LiveServer, key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{live.base_url}/v1", api_key=key, max_retries=0)


def sse_events(response: httpx.Response) -> list[Any]:
    """The SSE events of a whole response: decoded JSON, and the string "[DONE]"."""
    events = []
    for block in response.text.split("\n\n"):
        if block:
            assert block.startswith("data: "), block
            payload = block[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def chat_body(model: str = MODEL, **fields: Any) -> dict[str, Any]:
    return {"model": model, "messages": HELLO, "max_tokens": 8, **fields}
