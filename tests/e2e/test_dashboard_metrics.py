"""Every series the Grafana dashboard and the autoscaler query is exported by a live server.

A real uvicorn server over the tiny random-weight Llama, speculating with n-gram lookup on every
decoding request (mode "always"), serves a few completions whose prompts repeat themselves (so
the n-gram proposer finds drafts and some are accepted); then /metrics is scraped and parsed with
prometheus_client's parser. The names come from the dashboard JSON and the Prometheus adapter
rules (tests/unit/deploy/ reads them the same way).
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server.app import create_app
from server.settings import Settings
from tests.e2e.conftest import IDLE, LiveServer, live_server, wait_idle
from tests.metric_schema import EXPORTED
from tests.unit.deploy.helpers import deployment_metric_names

MODEL = "tiny-spec"
PROMPTS = (
    "one two three four one two three four one two three four one two",
    "def f(x): return x + 1\ndef g(x): return x + 1\ndef h(x): return x +",
    "abc abc abc abc abc abc abc abc abc abc abc abc abc abc abc abc",
)


@pytest.fixture(scope="module")
def spec_server(tiny_chat_model) -> Iterator[LiveServer]:
    settings = Settings(
        model=str(tiny_chat_model),
        served_model_name=MODEL,
        dtype="float32",
        max_model_len=512,
        num_kv_blocks=128,
        max_num_seqs=4,
        max_num_batched_tokens=256,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4, "mode": "always"},
    )
    with live_server(create_app(settings)) as live:
        yield live


def _serve_some_requests(live: LiveServer) -> None:
    with httpx.Client(base_url=live.base_url, timeout=60) as client:
        for i, prompt in enumerate(PROMPTS):
            body = {
                "model": MODEL,
                "prompt": prompt,
                "max_tokens": 32 if i else 4,  # one finishes by length early
                "temperature": 0,
                "ignore_eos": True,
            }
            response = client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
        chat = {
            "model": MODEL,
            "messages": [{"role": "user", "content": PROMPTS[0]}],
            "max_tokens": 16,
            "stream": True,
        }
        with client.stream("POST", "/v1/chat/completions", json=chat) as stream:
            assert stream.status_code == 200
            assert any(line.startswith("data: [DONE]") for line in stream.iter_lines())


def _scrape(live: LiveServer) -> dict[str, list[dict[str, str]]]:
    """Sample name -> the label sets it was exported with."""
    text = httpx.get(f"{live.base_url}/metrics", timeout=30).text
    samples: dict[str, list[dict[str, str]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample.labels)
    return samples


def test_dashboard_and_autoscaler_series_are_exported(spec_server):
    _serve_some_requests(spec_server)
    assert wait_idle(spec_server) == IDLE
    samples = _scrape(spec_server)
    used = deployment_metric_names()
    assert len(used) >= 25  # the whole dashboard, not an empty parse
    missing = sorted(used - set(samples))
    assert not missing, f"queried but not exported: {missing}"
    # The unit tests check the dashboard against EXPORTED: it must be what the server says.
    assert not EXPORTED - set(samples), sorted(EXPORTED - set(samples))
    new = {n for n in samples if n.startswith("specserve:")} - EXPORTED
    assert not new, f"exported but not in EXPORTED (add them, and a panel): {sorted(new)}"
    for name in used:
        assert all(labels.get("model_name") == MODEL for labels in samples[name]), name


def test_speculation_series_carry_their_labels(spec_server):
    _serve_some_requests(spec_server)
    samples = _scrape(spec_server)
    positions = {
        labels["position"]
        for labels in samples["specserve:spec_decode_num_accepted_tokens_per_pos_total"]
    }
    assert positions <= {"1", "2", "3", "4"} and "1" in positions
    decisions = samples["specserve:spec_decode_policy_decisions_total"]
    assert {"decision", "reason"} <= set(decisions[0])
    reasons = {labels["finished_reason"] for labels in samples["specserve:request_success_total"]}
    assert "length" in reasons
