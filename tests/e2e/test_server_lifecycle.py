"""The HTTP server's life cycle end to end: a dead or failed engine answers 503, and `specserve
serve` run as a subprocess reads its settings, drains or cuts its streams on SIGTERM and exits when
the model does not load. Each test starts its own server: they stop or break it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from server.app import create_app
from tests.e2e.conftest import live_server, wait_healthy
from tests.e2e.server_helpers import HELLO, MODEL, chat_body, openai_client, server_settings


def test_dead_or_failed_engine_is_503(tiny_chat_model):
    with live_server(create_app(server_settings(tiny_chat_model))) as live:
        asyncio.run(live.async_engine.shutdown(timeout=0))
        health = httpx.get(f"{live.base_url}/health")
        assert (health.status_code, health.json()) == (503, {"status": "unavailable"})
        with pytest.raises(openai.InternalServerError) as e:
            openai_client(live).chat.completions.create(model=MODEL, messages=HELLO)
        assert e.value.status_code == 503 and e.value.response.headers["retry-after"]
    with live_server(
        create_app(server_settings(tiny_chat_model.parent / "missing")), wait=False
    ) as live:
        deadline = time.monotonic() + 20
        while httpx.get(f"{live.base_url}/health").json()["status"] == "loading":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        health = httpx.get(f"{live.base_url}/health")
        assert (health.status_code, health.json()) == (503, {"status": "failed"})


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _serve_in_process(config: Path, port: int, env: dict[str, str]) -> subprocess.Popen:
    command = [sys.executable, "-m", "server.cli", "serve", "--config", str(config)]
    return subprocess.Popen(
        [*command, "--port", str(port), "--log-level", "warning"],
        env=env,
        cwd=Path(__file__).resolve().parents[2],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def _stream_through_sigterm(process: subprocess.Popen, base: str, body: dict) -> list[str]:
    """The events of a stream that is in flight when the server gets SIGTERM; checks that the
    server then exits by itself and prints no traceback."""
    started, result = threading.Event(), {}

    def read() -> None:
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=120) as r:
            lines = []
            for line in r.iter_lines():
                lines.append(line)
                started.set()
            result["text"] = "\n".join(lines)

    reader = threading.Thread(target=read)
    reader.start()
    assert started.wait(30)
    process.send_signal(signal.SIGTERM)
    reader.join(120)
    # uvicorn re-raises the SIGTERM it caught once its shutdown is complete.
    assert process.wait(120) in (0, -signal.SIGTERM)
    assert process.stderr is not None and "Traceback" not in process.stderr.read().decode()
    return [line[6:] for line in result["text"].splitlines() if line]


def test_cli_serve_settings_and_graceful_sigterm(tiny_chat_model, tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "engine": {"model": str(tiny_chat_model), "dtype": "float32", "max_model_len": 512},
                "server": {"served_model_name": "from-yaml", "port": 1, "shutdown_timeout": 20},
            }
        )
    )
    port = _free_port()
    env = {**os.environ, "SPECSERVE_SERVED_MODEL_NAME": "from-env", "SPECSERVE_PORT": "2"}
    process = _serve_in_process(config, port, env)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base)
        assert httpx.get(f"{base}/v1/models").json()["data"][0]["id"] == "from-env"
        # A long stream is in flight when SIGTERM arrives: it is drained, not cut (on a machine
        # too loaded to finish 300 tokens of a tiny model in 20 s it is cut, and ends cleanly).
        body = {**chat_body("from-env", max_tokens=300, stream=True), "ignore_eos": True}
        events = _stream_through_sigterm(process, base, body)
        assert events[-1] == "[DONE]"
        tokens = [
            e
            for e in events[:-1]
            if json.loads(e).get("choices", [{}])[0].get("delta", {}).get("content")
        ]
        assert tokens
        last = json.loads(events[-2])
        if "error" not in last:
            assert last["choices"][0]["finish_reason"] == "length"
        else:
            assert last["error"]["code"] == "aborted"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_cli_serve_ends_the_streams_it_cuts_at_the_shutdown_timeout(tiny_chat_model, tmp_path):
    # shutdown_timeout 0: what is in flight at SIGTERM is aborted at once. Its stream still ends
    # as an OpenAI stream does when the server fails it (an error event, then [DONE]), before
    # uvicorn's own deadline cuts the connection, and the server prints no traceback.
    config = tmp_path / "serve.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "engine": {
                    "model": str(tiny_chat_model),
                    "dtype": "float32",
                    "max_model_len": 1024,
                },
                "server": {"served_model_name": "cut", "shutdown_timeout": 0},
            }
        )
    )
    port = _free_port()
    process = _serve_in_process(config, port, dict(os.environ))
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base)
        body = {**chat_body("cut", max_tokens=900, stream=True), "ignore_eos": True}
        events = _stream_through_sigterm(process, base, body)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "aborted" and error["type"] == "server_error"
        chunks = [json.loads(e) for e in events[:-2]]
        assert chunks and all(c["object"] == "chat.completion.chunk" for c in chunks)
        assert sum(len(c["choices"][0]["delta"].get("content") or "") > 0 for c in chunks) < 900
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_cli_serve_exits_when_the_model_does_not_load(tmp_path):
    process = subprocess.run(
        [sys.executable, "-m", "server.cli", "serve", "--model", str(tmp_path / "missing")],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "SPECSERVE_PORT": str(_free_port())},
    )
    assert process.returncode == 1
    assert "the engine failed to load" in process.stderr
