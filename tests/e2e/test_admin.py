"""GET /internal/engine-check: the block manager's integrity check over HTTP, behind the API key
only, with counts that match the engine's own."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from engine.engine import LLMEngine
from server.admin import check_engine
from server.app import create_app
from tests.e2e.conftest import LiveServer, live_server, tiny_settings, wait_idle

MODEL = "tiny-admin"
API_KEY = "sk-admin-test"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def keyed(tiny_chat_model) -> Iterator[LiveServer]:
    settings = tiny_settings(tiny_chat_model, MODEL, api_key=API_KEY, num_kv_blocks=64)
    with live_server(create_app(settings)) as live:
        yield live


def test_engine_check_counts_blocks_after_requests(keyed: LiveServer) -> None:
    prompt = "Hello there, " * 12  # two full 16-token blocks at least
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 5, "temperature": 0}
    for _ in range(2):
        response = httpx.post(f"{keyed.base_url}/v1/completions", json=body, headers=AUTH)
        assert response.status_code == 200
    wait_idle(keyed)
    response = httpx.get(f"{keyed.base_url}/internal/engine-check", headers=AUTH)
    assert response.status_code == 200
    check = response.json()
    assert check["ok"] is True and check["error"] is None
    assert check["num_kv_blocks"] == 64
    assert check["num_used_kv_blocks"] == 0
    assert check["num_free_kv_blocks"] == 64
    assert check["num_cached_kv_blocks"] > 0  # the prompt's full blocks stay in the prefix cache
    assert (check["num_running"], check["num_waiting"], check["num_unfinished"]) == (0, 0, 0)


def test_engine_check_needs_the_key(keyed: LiveServer) -> None:
    response = httpx.get(f"{keyed.base_url}/internal/engine-check")
    assert response.status_code == 401
    bad = {"Authorization": "Bearer sk-wrong"}
    assert httpx.get(f"{keyed.base_url}/internal/engine-check", headers=bad).status_code == 401


def test_engine_check_reports_a_broken_invariant(keyed: LiveServer) -> None:
    def corrupt_and_check(engine: LLMEngine):
        blocks = engine.block_manager
        block = blocks._blocks[0]
        block.ref_count += 1  # held by no block table
        try:
            return check_engine(engine)
        finally:
            block.ref_count -= 1

    check = keyed.call(corrupt_and_check)
    assert check.ok is False
    assert "block 0: ref count" in check.error
    assert keyed.call(check_engine).ok


def test_engine_check_is_absent_without_a_key(tiny_chat_model) -> None:
    settings = tiny_settings(tiny_chat_model, MODEL, num_kv_blocks=32)
    with live_server(create_app(settings)) as live:
        response = httpx.get(f"{live.base_url}/internal/engine-check")
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "not_found"
