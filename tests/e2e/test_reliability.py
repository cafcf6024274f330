"""bench/reliability/run.py at small scale, the same code paths against a real `specserve serve`
subprocess over the tiny random-weight chat model: a churn of 60 streams at concurrency 8 with
30% closed by the client at random moments and a 16-block KV pool that forces preemption; a
15-second soak; 100 schemathesis cases, streaming included.

Asserted: no request fails; /metrics counted preemptions and reads 0 running, 0 waiting, 0 KV
usage after each part; the engine check (GET /internal/engine-check) passes; every completed
churn request equals its solo run, text and token count; no 5xx and no broken stream in the fuzz.
The soak only has to complete and report its RSS samples: 15 seconds after a churn is too short
for a growth bound that would mean anything (allocator arenas still settle), so the bound is the
full bench's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.reliability import report as RR
from bench.reliability import run as R

pytest.importorskip("schemathesis")


@pytest.fixture(scope="module")
def results(tiny_chat_model: Path) -> Any:
    settings = R.BenchSettings(
        model=str(tiny_chat_model),
        num_kv_blocks=16,
        max_num_seqs=8,
        requests=60,
        concurrency=8,
        cancel_fraction=0.3,
        max_cancel_delay=0.3,  # a tiny-model stream lasts a fraction of a second
        distinct=20,
        max_tokens=(8, 48),
        soak_minutes=0.25,
        rss_interval=1.0,
        fuzz_cases=100,
        idle_timeout=30.0,
        startup_timeout=300.0,
    )
    return R.run_all(settings)


def test_churn_preempts_cancels_and_leaves_nothing_behind(results: Any) -> None:
    churn = results.churn
    summary = RR.churn_summary(churn)
    assert churn.num_requests == 60
    assert churn.num_errors == 0, (summary, churn.errors)
    assert churn.num_cancelled > 0, summary
    assert churn.num_completed + churn.num_cancelled == 60, summary
    assert churn.num_preemptions > 0, summary
    assert churn.idle.is_idle, churn.idle
    assert churn.idle.check["ok"] is True, churn.idle.check
    assert churn.idle.check["num_used_kv_blocks"] == 0
    assert churn.idle.check["num_unfinished"] == 0


def test_churn_outputs_equal_their_solo_runs(results: Any) -> None:
    churn = results.churn
    assert churn.num_compared == churn.num_completed > 0
    assert churn.num_distinct_compared > 1
    assert not churn.mismatches, churn.mismatches[:3]


def test_soak_completes_and_reports_rss(results: Any) -> None:
    soak = results.soak
    assert soak.num_errors == 0, soak.errors
    assert soak.num_completed > 0
    assert len(soak.rss_samples) >= 3
    assert all(kib > 0 for _, kib in soak.rss_samples)
    assert soak.rss_baseline_kib > 0 and soak.rss_end_kib > 0
    assert soak.idle.is_idle and soak.idle.check["ok"] is True, soak.idle


def test_fuzz_finds_no_server_error(results: Any) -> None:
    fuzz = results.fuzz
    assert fuzz.num_cases == 100, fuzz
    assert fuzz.num_5xx == 0, fuzz.examples
    assert fuzz.num_transport_errors == 0 and fuzz.num_broken_streams == 0, fuzz.examples
    assert fuzz.statuses.get("200", 0) > 0
    assert fuzz.num_streamed > 0  # half the cases stream; derandomised, the same ones each run
    assert results.fuzz_idle.is_idle and results.fuzz_idle.check["ok"] is True


def test_every_correctness_check_holds(results: Any) -> None:
    checks = RR.verdicts(results)
    failed = [c for c in checks if c["kind"] == "correctness" and not c["held"]]
    assert not failed, failed
    report = RR.report(results, checks)
    assert "| churn | preemptions |" in report
