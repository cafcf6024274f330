"""Clients that hold a connection without finishing their part, against a real uvicorn server
configured as the CLI configures it: headers sent slowly or never, a body that never completes,
an oversized body (413 however it is sent), a client that stops reading its stream. Every
timeout is configured tiny here; each test only bounds how long the server may take to act."""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from server.app import create_app
from tests.e2e.conftest import IDLE, LiveServer, live_server, tiny_settings, wait_idle

MODEL = "tiny-slow"
TIMEOUT_S = 0.5  # header, body and stall timeouts of the `server` fixture
MAX_BODY = 64 << 10
ACT_WITHIN_S = 20.0  # how long a test waits for the server to act (a loaded machine is slow)


@pytest.fixture(scope="module")
def server(tiny_chat_model: Path) -> Iterator[LiveServer]:
    settings = tiny_settings(
        tiny_chat_model,
        MODEL,
        header_timeout=TIMEOUT_S,
        body_timeout=TIMEOUT_S,
        stream_stall_timeout=TIMEOUT_S,
        max_body_bytes=MAX_BODY,
        max_drained_body_bytes=1 << 20,
        log_stats_interval=0,
    )
    with live_server(create_app(settings), send_buffer_bytes=16 << 10) as live:
        yield live


def _connect(live: LiveServer, **options: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    for name, value in options.items():
        sock.setsockopt(socket.SOL_SOCKET, getattr(socket, name), value)
    sock.connect(("127.0.0.1", live.port))
    sock.settimeout(ACT_WITHIN_S)
    return sock


def _read_to_close(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a reset counts as closed);
    socket.timeout if it does not close in time."""
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except ConnectionResetError:
        pass
    return received


def _head(method: str = "POST", path: str = "/v1/completions", **headers: str) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: test", "Content-Type: application/json"]
    lines += [f"{name.replace('_', '-')}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _envelope(response: bytes) -> tuple[int, dict[str, str], dict]:
    head, _, body = response.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in header_lines)
    return int(status_line.split()[1]), headers, json.loads(body)["error"]


def test_headers_that_never_complete_are_cut(server):
    start = time.monotonic()
    with _connect(server) as silent, _connect(server) as slow:
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\n")
        with contextlib.suppress(OSError):  # already cut: what the test waits for
            for _ in range(3):  # a byte at a time keeps uvicorn's own keep-alive timer at bay
                time.sleep(TIMEOUT_S / 5)
                slow.sendall(b"X")
        assert _read_to_close(silent) == b""  # opened, never sent anything
        assert _read_to_close(slow) == b""
    assert time.monotonic() - start < ACT_WITHIN_S
    # A request that completes its headers in time is served, and the connection kept.
    with _connect(server) as client:
        client.sendall(_head("GET", "/health"))
        assert client.recv(65536).startswith(b"HTTP/1.1 200")


def test_a_body_that_never_completes_is_408(server):
    with _connect(server) as short:  # Content-Length promises more than is sent
        short.sendall(_head(Content_Length="100") + b'{"model": ')
        status, headers, error = _envelope(_read_to_close(short))
    assert (status, headers["connection"], error["code"]) == (408, "close", "request_timeout")
    assert "body_timeout" in error["message"] and error["type"] == "invalid_request_error"
    with _connect(server) as trickle:  # one byte at a time, never done in time
        trickle.sendall(_head(Content_Length="1000"))
        with pytest.raises(OSError):
            for _ in range(int(ACT_WITHIN_S / 0.05)):
                trickle.sendall(b" ")
                time.sleep(0.05)
            pytest.fail("the server kept reading a body that takes forever")


@pytest.mark.parametrize("chunked", [True, False])
def test_oversized_bodies_get_the_413_envelope(tiny_chat_model, chunked):
    # 20 MB, sent as fast as it goes: the server reads and drops it, then answers and closes.
    big = 20 << 20
    settings = tiny_settings(tiny_chat_model, MODEL, body_timeout=60, log_stats_interval=0)
    content = iter([b"x" * (1 << 20)] * (big >> 20)) if chunked else b"x" * big
    with live_server(create_app(settings)) as live, httpx.Client(timeout=60) as http:
        response = http.post(f"{live.base_url}/v1/completions", content=content)
        assert response.status_code == 413 and response.headers["connection"] == "close"
        error = response.json()["error"]
        assert error["code"] == "request_too_large" and "max_body_bytes" in error["message"]
        assert http.get(f"{live.base_url}/health").status_code == 200  # a new connection


def test_an_endless_oversized_body_is_cut(server):
    # Past max_drained_body_bytes the server stops reading and closes.
    with _connect(server) as endless:
        endless.sendall(_head(Transfer_Encoding="chunked"))
        chunk = b"%x\r\n%s\r\n" % (65536, b"x" * 65536)
        with pytest.raises(OSError):
            for _ in range(4096):  # 256 MiB: far past the 1 MiB drained
                endless.sendall(chunk)
            pytest.fail("the server kept reading an oversized body")


def test_a_client_that_stops_reading_is_cut_and_its_requests_aborted(server, caplog):
    # Fat chunks (logprobs) from four sequences fill the socket buffers (small ones: see the
    # fixture) of a client that reads nothing long before they are done.
    body = {
        "model": MODEL,
        "prompt": "Once upon a time",
        "n": 4,
        "max_tokens": 400,
        "logprobs": 5,
        "ignore_eos": True,
        "stream": True,
    }
    payload = json.dumps(body).encode()
    finished_before = dict(server.call(lambda engine: dict(engine.metrics.num_finished)))
    with caplog.at_level(logging.INFO), _connect(server, SO_RCVBUF=4096) as client:
        client.sendall(_head(Content_Length=str(len(payload))) + payload)
        deadline = time.monotonic() + ACT_WITHIN_S
        while server.state.counters.num_stream_stalls == 0:
            assert time.monotonic() < deadline, "the stalled stream was never cut"
            time.sleep(0.05)
        assert wait_idle(server) == IDLE  # aborted, every KV block back
        _read_to_close(client)  # what was buffered, then the close
    finished = server.call(lambda engine: dict(engine.metrics.num_finished))
    assert finished.get("abort", 0) - finished_before.get("abort", 0) == 4
    assert finished.get("length", 0) == finished_before.get("length", 0)
    blocks = server.call(lambda e: (e.block_manager.num_free_blocks, e.block_manager.num_blocks))
    assert blocks[0] == blocks[1]
    metrics = httpx.get(f"{server.base_url}/metrics").text
    assert f'specserve:stream_stalls_total{{model_name="{MODEL}"}} 1.0' in metrics
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert any("read nothing" in r.getMessage() for r in caplog.records)
