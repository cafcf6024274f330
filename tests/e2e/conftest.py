"""End-to-end fixtures: a tiny random-weight Llama that has a real tokenizer and chat template,
and real uvicorn servers on free loopback ports, each in a background thread.

`server` (default settings) and `schemas` (OpenAPI validators) are package-scoped: the
test_server_* modules share one server instead of starting one each. A module that needs other
settings defines its own `server`, which takes precedence; a test that changes the shared one's
state puts it back.

The tokenizer is the bundled SmolLM2 conversion's (vocabulary 49152, eos id 2, ChatML template);
the model is one layer of width 32 over that vocabulary, so a step takes about a millisecond.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from engine.engine import LLMEngine
from server.app import create_app
from server.async_engine import AsyncEngine
from server.connections import uvicorn_config
from server.settings import Settings
from server.state import ServerState, Serving, server_state
from tests.conftest import build_tiny_model
from tests.e2e.server_helpers import SCHEMA_NAMES, server_settings
from tests.openapi_spec import spec_schemas, validators

T = TypeVar("T")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "generation_config.json",
)
STARTUP_TIMEOUT_S = 60.0


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory) -> Path:
    """A 1-layer, width-32 Llama with SmolLM2's tokenizer and chat template (eos id 2)."""
    return build_chat_model(
        tmp_path_factory.mktemp("tiny-chat"),
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
    )


def smollm2_tokenizer_dir() -> Path:
    """Where SmolLM2's tokenizer files are: the bundled model, else the folder named by
    SPECSERVE_SMOLLM2_TOKENIZER (a GPU node, which gets the tokenizer without the weights:
    deploy/gpu_wheels.py); skips the test where neither has them."""
    from engine.models.bundled import resolve_model

    try:
        return Path(resolve_model("smollm2-135m-instruct"))
    except Exception as e:  # not installed: `specserve install-model smollm2-135m-instruct`
        carried = os.environ.get("SPECSERVE_SMOLLM2_TOKENIZER")
        if carried and (Path(carried) / "tokenizer.json").is_file():
            return Path(carried)
        pytest.skip(f"the bundled SmolLM2 tokenizer is not available: {e}")


def build_chat_model(directory: Path, **config: object) -> Path:
    """A 1-layer Llama over SmolLM2's vocabulary in `directory`, with the bundled SmolLM2
    tokenizer and chat template copied beside it (skips the test where SmolLM2 is not
    installed); `config` gives the shape (and seed)."""
    source = smollm2_tokenizer_dir()
    path = build_tiny_model(
        directory,
        "llama",
        vocab_size=49152,
        num_hidden_layers=1,
        max_position_embeddings=1024,
        **config,
    )
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, path / name)
    return path


def tiny_settings(model_path: Path, name: str, **overrides: Any) -> Settings:
    """Server settings for a tiny chat model served as `name`: float32, a 512-token context,
    16-token KV blocks; `overrides` replace or add fields."""
    values: dict[str, Any] = dict(
        model=str(model_path),
        served_model_name=name,
        dtype="float32",
        max_model_len=512,
        block_size=16,
        num_kv_blocks=256,
        max_num_seqs=16,
        max_num_batched_tokens=512,
    )
    return Settings(**{**values, **overrides})


@dataclass
class LiveServer:
    """A uvicorn server running `app` in a thread; `base_url` has no trailing slash."""

    app: FastAPI
    server: uvicorn.Server
    thread: threading.Thread
    port: int

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def state(self) -> ServerState:
        return server_state(self.app)

    @property
    def serving(self) -> Serving:
        """What the app serves with (it must serve by now)."""
        serving = self.state.serving
        assert serving is not None, "the engine does not serve"
        return serving

    @property
    def async_engine(self) -> AsyncEngine:
        return self.serving.async_engine

    def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn(engine)` on the engine thread (between steps) and return its result."""
        return asyncio.run(asyncio.wait_for(self.async_engine.call(fn), 30))


@contextmanager
def live_server(
    app: FastAPI, wait: bool = True, send_buffer_bytes: int | None = None
) -> Iterator[LiveServer]:
    """Serve `app` on a free loopback port until the block ends; `wait`: until /health is 200.
    uvicorn is configured as the CLI configures it (`uvicorn_config`: the app's timeouts).
    `send_buffer_bytes` fixes the connections' kernel send buffers (else loopback lets them grow
    to megabytes before a client that reads nothing holds a response back)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if send_buffer_bytes is not None:  # accepted connections inherit it
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn_config(app, server_state(app).settings, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    live = LiveServer(app, server, thread, port)
    try:
        if wait:
            wait_healthy(live.base_url, thread)
        else:
            _wait_listening(live.base_url, thread)
        yield live
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def wait_healthy(base_url: str, thread: threading.Thread | None = None) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if thread is not None and not thread.is_alive():
            raise RuntimeError("the server thread exited during start-up")
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{base_url} did not become healthy in {STARTUP_TIMEOUT_S} s")


def _wait_listening(base_url: str, thread: threading.Thread) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while thread.is_alive() and time.monotonic() < deadline:
        try:
            httpx.get(f"{base_url}/health", timeout=2)
            return
        except httpx.HTTPError:
            time.sleep(0.05)
    raise TimeoutError(f"{base_url} is not listening")


def engine_state(engine: LLMEngine) -> dict[str, Any]:
    """What an idle engine must show: nothing running or waiting, no block in use."""
    engine.block_manager.check_integrity()
    return {
        "running": len(engine.scheduler.running),
        "waiting": len(engine.scheduler.waiting),
        "used_blocks": engine.block_manager.num_used_blocks,
        "unfinished": engine.num_unfinished_requests,
    }


IDLE = {"running": 0, "waiting": 0, "used_blocks": 0, "unfinished": 0}


def wait_idle(live: LiveServer, timeout_s: float = 20.0) -> dict[str, Any]:
    """The engine state once it is idle (or the last one seen when the timeout passes)."""
    deadline = time.monotonic() + timeout_s
    state = live.call(engine_state)
    while state != IDLE and time.monotonic() < deadline:
        time.sleep(0.02)
        state = live.call(engine_state)
    return state


@pytest.fixture(scope="package")
def server(tiny_chat_model) -> Iterator[LiveServer]:
    """The default-settings server (engine loaded by the app's lifespan) that the test_server_*
    modules share."""
    with live_server(create_app(server_settings(tiny_chat_model))) as live:
        yield live


@pytest.fixture(scope="package")
def schemas() -> dict[str, Any]:
    """Validators for SCHEMA_NAMES from the official OpenAPI spec (read once: it is large)."""
    return validators(SCHEMA_NAMES, spec_schemas())
