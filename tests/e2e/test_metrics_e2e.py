"""/metrics over HTTP: after a known workload every documented series is there and the counts
match what the responses reported; after clients abandon long streams, the gauges return to 0.
The periodic stats line appears in the log."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server.app import create_app
from server.settings import Settings
from tests.e2e.conftest import IDLE, LiveServer, live_server, wait_idle
from tests.metric_schema import COUNTERS, GAUGES, HISTOGRAMS

MODEL = "tiny-metrics"
LABEL = {"model_name": MODEL}
SKIP_REASONS = (
    "request_opt_out",
    "batch_size",
    "utilization",
    "compute_bound",
    "low_acceptance",
    "catch_up_cost",
    "mode_off",
)


@pytest.fixture(scope="module")
def server(tiny_chat_model) -> Iterator[LiveServer]:
    settings = Settings(
        model=str(tiny_chat_model),
        served_model_name=MODEL,
        dtype="float32",
        max_model_len=1024,
        block_size=16,
        num_kv_blocks=512,
        max_num_seqs=16,
        max_num_batched_tokens=512,
        speculative_config={
            "method": "ngram",
            "mode": "always",
            "num_speculative_tokens": 3,
            "prompt_lookup_min": 1,
        },
        log_stats_interval=0.2,
    )
    with live_server(create_app(settings)) as live:
        yield live


class Scrape:
    """One parse of /metrics: sample values by (exposed name, labels beyond model_name)."""

    def __init__(self, text: str) -> None:
        self.families = list(text_string_to_metric_families(text))
        self.samples: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
        for family in self.families:
            for sample in family.samples:
                assert sample.labels["model_name"] == MODEL, sample
                labels = {k: v for k, v in sample.labels.items() if k != "model_name"}
                self.samples[(sample.name, frozenset(labels.items()))] = sample.value

    def __call__(self, name: str, **labels: str) -> float:
        return self.samples[("specserve:" + name, frozenset(labels.items()))]

    def names(self) -> set[str]:
        return {name for name, _ in self.samples}


def _scrape(live: LiveServer) -> Scrape:
    response = httpx.get(f"{live.base_url}/metrics")
    assert response.status_code == 200
    return Scrape(response.text)


def _client(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.base_url}/v1", api_key="unused", max_retries=0)


def test_counts_match_the_responses(server, caplog) -> None:
    caplog.set_level(logging.INFO, logger="server.app")
    client = _client(server)
    ignore_eos: Any = {"ignore_eos": True}
    responses = []
    for i, content in enumerate(["Hello there", "one two one two one two", "abc abc abc abc"]):
        messages = [{"role": "user", "content": content}]
        response = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=8 + 4 * i,
            temperature=0,  # greedy: the prediction below is exactly the first answer
            extra_body=ignore_eos,
        )
        responses.append(response)
    # The first answer again, predicted: its drafts are accepted.
    predicted = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hello there"}],
        max_tokens=8,
        temperature=0,
        prediction={"type": "content", "content": responses[0].choices[0].message.content},
        extra_body=ignore_eos,
    )
    usages = [r.usage for r in (*responses, predicted)]
    batch = client.completions.create(
        model=MODEL,
        prompt=["x y x y x y", "The sky is"],
        max_tokens=10,
        temperature=0,
        extra_body=ignore_eos,
    )
    usages.append(batch.usage)
    num_requests = 4 + 2  # the batch is two engine requests
    assert wait_idle(server) == IDLE
    m = _scrape(server)

    exposed = m.names()
    for name in GAUGES:
        assert "specserve:" + name in exposed, name
    for name in COUNTERS:
        assert f"specserve:{name}_total" in exposed, name
    for name in HISTOGRAMS:
        for part in ("_bucket", "_sum", "_count"):
            assert f"specserve:{name}{part}" in exposed, name + part
    for reason in SKIP_REASONS:
        assert ("specserve:spec_decode_policy_decisions_total", _labels(reason)) in m.samples

    num_prompt = sum(u.prompt_tokens for u in usages)
    num_generated = sum(u.completion_tokens for u in usages)
    assert num_generated == 8 + 12 + 16 + 8 + 2 * 10
    assert m("prompt_tokens_total") == num_prompt
    assert m("generation_tokens_total") == num_generated
    assert m("request_success_total", finished_reason="length") == num_requests
    assert m("request_success_total", finished_reason="stop") == 0
    assert m("request_success_total", finished_reason="abort") == 0
    assert m("num_preemptions_total") == 0
    assert m("prefix_cache_queries_total") == num_prompt  # each prompt looked up once
    assert m("prefix_cache_hits_total") <= num_prompt
    for name in ("time_to_first_token", "e2e_request_latency", "request_queue_time"):
        assert m(f"{name}_seconds_count") == num_requests, name
        assert m(f"{name}_seconds_bucket", le="+Inf") == num_requests, name
    assert m("inter_token_latency_seconds_count") == num_generated - num_requests
    assert m("time_to_first_token_seconds_sum") <= m("e2e_request_latency_seconds_sum")

    num_drafts = m("spec_decode_num_drafts_total")
    num_accepted = m("spec_decode_num_accepted_tokens_total")
    per_pos = [
        m("spec_decode_num_accepted_tokens_per_pos_total", position=str(p)) for p in (1, 2, 3)
    ]
    num_predicted = predicted.usage.completion_tokens_details.accepted_prediction_tokens
    assert (
        num_predicted > 0 and m("spec_decode_num_prediction_accepted_tokens_total") == num_predicted
    )
    assert num_drafts > 0 and sum(per_pos) == num_accepted >= num_predicted
    assert per_pos[0] >= per_pos[1] >= per_pos[2]  # accepting position 2 needs position 1
    assert m("spec_decode_num_draft_tokens_total") <= 3 * num_drafts
    assert m("spec_decode_verify_time_seconds_count") <= num_drafts  # steps batch requests
    assert m("spec_decode_verify_time_seconds_count") > 0
    decisions = sum(
        value
        for (name, _), value in m.samples.items()
        if name == "specserve:spec_decode_policy_decisions_total"
    )
    assert decisions == m("spec_decode_draft_tokens_per_step_count") > 0

    # The background task logged the interval's numbers.
    deadline = time.monotonic() + 10
    while not any("tokens/s" in r.getMessage() for r in caplog.records):
        assert time.monotonic() < deadline, "no stats log line"
        time.sleep(0.05)


def _labels(reason: str) -> frozenset[tuple[str, str]]:
    return frozenset({("decision", "skip"), ("reason", reason)})


def test_abandoned_streams_leave_nothing_running(server) -> None:
    client = _client(server)
    before = _scrape(server)
    num_streams = 4
    streams = []
    for i in range(num_streams):
        stream = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Tell me a long story, number {i}"}],
            max_tokens=900,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        streams.append((stream, iter(stream)))
    for _, chunks in streams:
        next(chunks)  # the role chunk
        next(chunks)  # a token: mid-generation
    during = _scrape(server)
    assert during("num_requests_running") + during("num_requests_waiting") > 0
    assert during("kv_cache_usage_perc") > 0
    for stream, _ in streams:
        stream.close()

    deadline = time.monotonic() + 20
    while True:
        m = _scrape(server)
        gauges = [m(name) for name in GAUGES[:3]]
        aborted = m("request_success_total", finished_reason="abort")
        if gauges == [0, 0, 0] and aborted == num_streams:
            break
        assert time.monotonic() < deadline, (gauges, aborted)
        time.sleep(0.05)
    assert wait_idle(server) == IDLE
    # The aborted streams' tokens count as generated; they add no end-to-end latency sample.
    assert m("generation_tokens_total") > before("generation_tokens_total")
    assert m("e2e_request_latency_seconds_count") == before("e2e_request_latency_seconds_count")
    assert m("time_to_first_token_seconds_count") == (
        before("time_to_first_token_seconds_count") + num_streams
    )
