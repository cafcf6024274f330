"""Start-up logs one line per phase with its time, and the server ends with "ready in X s"."""

from __future__ import annotations

import asyncio
import logging
import re
import time

import pytest

from engine import LLM, kernels
from engine.policy import setup
from engine.policy.step_time import StepTimeModel
from server.app import create_app
from server.settings import Settings
from server.state import server_state

_PHASE = re.compile(r"startup: (.+) (\d+\.\d) s")


def _phases(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The phases logged, in order; every startup line must carry its time."""
    lines = [r.getMessage() for r in caplog.records if r.name == "engine.runtime.startup"]
    lines = [line for line in lines if line.startswith("startup: ")]
    matches = [_PHASE.fullmatch(line) for line in lines]
    assert all(matches), lines
    return [m.group(1) for m in matches if m]


def test_engine_logs_each_phase_with_its_time(tiny_llama, caplog, monkeypatch):
    # The calibration's own timing is not what this checks: a fit stands in for it.
    monkeypatch.setattr(
        setup, "load_or_calibrate", lambda *args, **kwargs: StepTimeModel([1], [1.0])
    )
    kernels.cpu_kernels()  # loaded before, as the CLI's settings resolution does
    with caplog.at_level(logging.INFO, logger="engine.runtime.startup"):
        LLM(
            str(tiny_llama),
            dtype="float32",
            num_kv_blocks=32,
            speculative_config={"method": "ngram", "mode": "auto"},
        )
    assert _phases(caplog) == [
        f"model files {tiny_llama}",
        "config and tokenizer",
        f"load weights {tiny_llama.name}",
        "KV cache",
        "calibration",
    ]


def test_the_kernel_build_is_a_phase_of_its_own(caplog, monkeypatch):
    built = object()
    monkeypatch.setattr(kernels, "_loaded", {})  # as in a fresh process
    monkeypatch.setattr(kernels, "unavailable_reason", lambda: None)
    monkeypatch.setattr(kernels, "_build", lambda: built)
    with caplog.at_level(logging.INFO, logger="engine.runtime.startup"):
        assert kernels.cpu_kernels() is built
        assert kernels.cpu_kernels() is built  # once per process
    assert _phases(caplog) == ["CPU kernels"]


def test_draft_model_phases_are_logged(tiny_llama, caplog):
    with caplog.at_level(logging.INFO, logger="engine.runtime.startup"):
        LLM(
            str(tiny_llama),
            dtype="float32",
            num_kv_blocks=32,
            speculative_config={
                "method": "draft_model",
                "model": str(tiny_llama),
                "mode": "always",
            },
        )
    phases = _phases(caplog)
    assert phases[-3:] == [
        f"model files {tiny_llama}",
        f"load weights {tiny_llama.name} (draft)",
        "KV cache",
    ]


def test_server_logs_ready_in_from_the_start(tiny_llama, caplog):
    kernels.cpu_kernels()  # loaded before, as the CLI's settings resolution does
    settings = Settings(model=str(tiny_llama), dtype="float32", num_kv_blocks=32)
    app = create_app(settings, started=time.monotonic() - 30.0)  # the command began 30 s ago
    state = server_state(app)

    async def start_then_stop() -> None:
        async with app.router.lifespan_context(app):
            deadline = time.monotonic() + 60
            while state.serving is None and state.lifecycle.load_error is None:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)

    with caplog.at_level(logging.INFO):
        asyncio.run(start_then_stop())
    assert state.lifecycle.load_error is None
    messages = [r.getMessage() for r in caplog.records if r.name == "engine.runtime.startup"]
    ready = [m for m in messages if m.startswith("ready in ")]
    assert len(ready) == 1 and messages[-1] == ready[0]
    match = re.fullmatch(r"ready in (\d+\.\d) s: serving (.+) as '(.+)'", ready[0])
    assert match and float(match.group(1)) >= 30.0
    assert (match.group(2), match.group(3)) == (str(tiny_llama), str(tiny_llama))
    phases = _phases(caplog)
    assert phases[0] == f"model files {tiny_llama}" and phases[-1] == "server"
    assert f"load weights {tiny_llama.name}" in phases
