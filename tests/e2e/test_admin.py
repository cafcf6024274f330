"""The operator routes under /internal/, behind the API key only: GET engine-check (the block
manager's integrity check, with counts that match the engine's own), GET / PUT speculation (the
policy's mode, switched between steps without changing any output) and POST reset-prefix-cache."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from engine.engine import LLMEngine
from server.app import create_app
from server.routes.admin import check_engine
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


def test_the_operator_routes_are_absent_without_a_key(tiny_chat_model) -> None:
    settings = tiny_settings(tiny_chat_model, MODEL, num_kv_blocks=32)
    with live_server(create_app(settings)) as live:
        for method, path, body in [
            ("GET", "engine-check", None),
            ("GET", "speculation", None),
            ("PUT", "speculation", {"mode": "off"}),
            ("POST", "reset-prefix-cache", None),
        ]:
            url = f"{live.base_url}/internal/{path}"
            response = httpx.request(method, url, json=body)
            assert response.status_code == 404, path
            assert response.json()["error"]["code"] == "not_found"


@pytest.fixture(scope="module")
def speculating(tiny_chat_model) -> Iterator[LiveServer]:
    spec = {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_min": 1,
        "mode": "always",
    }
    settings = tiny_settings(
        tiny_chat_model, MODEL, api_key=API_KEY, num_kv_blocks=64, speculative_config=spec
    )
    with live_server(create_app(settings)) as live:
        yield live


def _decisions(live: LiveServer) -> dict[tuple[str, str], int]:
    return live.call(lambda engine: dict(engine.policy_stats.decisions))


def _chat(live: LiveServer, prediction: str | None = None) -> tuple[str, int]:
    """A greedy reply and how many of its tokens came from accepted prediction drafts."""
    body: dict[str, object] = {"model": MODEL, "max_tokens": 12, "temperature": 0}
    body |= {"messages": [{"role": "user", "content": "Count with me"}], "ignore_eos": True}
    if prediction is not None:
        body["prediction"] = {"type": "content", "content": prediction}
    response = httpx.post(f"{live.base_url}/v1/chat/completions", json=body, headers=AUTH)
    assert response.status_code == 200, response.text
    reply = response.json()
    accepted = reply["usage"]["completion_tokens_details"]["accepted_prediction_tokens"]
    return reply["choices"][0]["message"]["content"], accepted


def _put_mode(live: LiveServer, body: object, headers: dict[str, str] = AUTH) -> httpx.Response:
    return httpx.put(f"{live.base_url}/internal/speculation", json=body, headers=headers)


def test_the_speculation_mode_switches_without_changing_outputs(speculating: LiveServer) -> None:
    url = f"{speculating.base_url}/internal/speculation"
    assert httpx.get(url, headers=AUTH).json() == {"mode": "always"}
    text, _ = _chat(speculating)
    before = _decisions(speculating)
    drafted, accepted = _chat(speculating, prediction=text)  # a right prediction: drafts pay
    during = _decisions(speculating)
    assert drafted == text and accepted > 0
    assert during.get(("speculate", "fixed"), 0) > before.get(("speculate", "fixed"), 0)

    response = _put_mode(speculating, {"mode": "off"})
    assert response.status_code == 200 and response.json() == {"mode": "off"}
    assert httpx.get(url, headers=AUTH).json() == {"mode": "off"}
    plain, accepted = _chat(speculating, prediction=text)
    assert plain == text and accepted == 0  # nothing drafted, the same greedy tokens
    after = _decisions(speculating)
    assert after.get(("speculate", "fixed"), 0) == during.get(("speculate", "fixed"), 0)
    assert after.get(("skip", "mode_off"), 0) > during.get(("skip", "mode_off"), 0)
    assert _put_mode(speculating, {"mode": "always"}).status_code == 200
    assert _chat(speculating, prediction=text)[1] > 0


def test_a_bad_or_impossible_mode_is_a_400_that_changes_nothing(speculating: LiveServer) -> None:
    url = f"{speculating.base_url}/internal/speculation"
    # auto prices drafts with the step-time model calibrated at start, which this server skipped.
    for body in [{"mode": "auto"}, {"mode": "sometimes"}, {"mode": 1}, {}, ["off"]]:
        response = _put_mode(speculating, body)
        assert response.status_code == 400, body
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == "mode", body
    assert "calibrated" in _put_mode(speculating, {"mode": "auto"}).json()["error"]["message"]
    raw = httpx.put(url, content=b"{not json", headers=AUTH)
    assert raw.status_code == 400
    assert _put_mode(speculating, {"mode": "off"}, headers={}).status_code == 401
    assert httpx.get(url, headers=AUTH).json() == {"mode": "always"}


def test_reset_prefix_cache_drops_the_cached_blocks(speculating: LiveServer) -> None:
    body = {"model": MODEL, "prompt": "Hello there, " * 12, "max_tokens": 3, "temperature": 0}
    response = httpx.post(f"{speculating.base_url}/v1/completions", json=body, headers=AUTH)
    assert response.status_code == 200
    wait_idle(speculating)
    check = speculating.call(check_engine)
    assert check.num_cached_kv_blocks > 0
    url = f"{speculating.base_url}/internal/reset-prefix-cache"
    assert httpx.post(url).status_code == 401
    response = httpx.post(url, headers=AUTH)
    assert response.status_code == 200
    assert response.json() == {"num_dropped_blocks": check.num_cached_kv_blocks}
    after = speculating.call(check_engine)
    assert after.ok and after.num_cached_kv_blocks == 0
    assert after.num_free_kv_blocks == check.num_free_kv_blocks  # dropped, not lost
    hits = speculating.call(lambda engine: engine.scheduler.num_prefix_cache_hits)
    response = httpx.post(f"{speculating.base_url}/v1/completions", json=body, headers=AUTH)
    assert response.status_code == 200
    assert speculating.call(lambda engine: engine.scheduler.num_prefix_cache_hits) == hits
