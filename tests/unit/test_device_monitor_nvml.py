"""The utilization limit on a GPU, with a fake NVML (issue 33, F7).

NVML's "gpu" utilization is the share of time any kernel ran: ~100% whenever the engine steps, at
batch 1 as at batch 64. Read as "the device is busy", it turned speculation off at every load.
On a MIG instance its query raises NOT_SUPPORTED, and it raised inside a step. The fake pynvml
(in sys.modules) reports 100% or raises, and counts its queries.
"""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch

from engine.core.request import Request
from engine.core.schedule import Candidate, StepShape
from engine.policy.device_monitor import KneeMonitor, NvmlMonitor, make_monitor
from engine.policy.policy import SpeculationPolicy
from engine.sampling_params import SamplingParams
from tests.policy_fakes import FlatThenLinear

CUDA = torch.device("cuda", 0)  # only named: nothing here touches a GPU


class NVMLError(Exception):
    pass


def fake_pynvml(gpu_percent: int, *, query_raises: bool = False) -> types.ModuleType:
    """A pynvml whose device is `gpu_percent` busy by kernel time, or whose utilization query
    raises (a MIG instance: NVML_ERROR_NOT_SUPPORTED). `module.queries` counts the queries."""
    module = types.ModuleType("pynvml")
    module.queries = 0  # type: ignore[attr-defined]
    module.NVMLError = NVMLError  # type: ignore[attr-defined]

    def get_rates(handle):
        module.queries += 1  # type: ignore[attr-defined]
        if query_raises:
            raise NVMLError("Not Supported")
        return types.SimpleNamespace(gpu=gpu_percent, memory=30)

    module.nvmlInit = lambda: None  # type: ignore[attr-defined]
    module.nvmlDeviceGetHandleByIndex = lambda index: ("handle", index)  # type: ignore[attr-defined]
    module.nvmlDeviceGetHandleByUUID = lambda uuid: ("handle", uuid)  # type: ignore[attr-defined]
    module.nvmlDeviceGetUtilizationRates = get_rates  # type: ignore[attr-defined]
    return module


class _Knee:
    knee = 16  # the step-time model's compute-bound knee, in query tokens


def _policy(monitor) -> SpeculationPolicy:
    return SpeculationPolicy(
        "always", 4, FlatThenLinear(), monitor=monitor, disable_utilization=0.9
    )


def _decide(policy: SpeculationPolicy, batch_size: int) -> list[tuple[int, str | None]]:
    params = SamplingParams(max_tokens=64)
    candidates = [
        Candidate(Request(f"r{i}", [1, 2, 3], params, 64), 4, "ngram") for i in range(batch_size)
    ]
    shape = StepShape(batch_size, batch_size, 0, 4096, batch_size)
    return [(d.num_draft_tokens, d.reason) for d in policy.decide(candidates, shape)]


def test_full_kernel_time_does_not_turn_speculation_off(monkeypatch):
    nvml = fake_pynvml(100)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    policy = _policy(make_monitor(CUDA, _Knee()))
    for _ in range(5):  # an engine stepping continuously: NVML would read 100% every time
        assert _decide(policy, 1) == [(4, "fixed")]
    # The limit still holds where the step itself is compute-bound: at the knee.
    assert {d for d in _decide(policy, 16)} == {(0, "utilization")}
    assert nvml.queries == 0  # kernel time never judges "compute-bound"


def test_a_device_whose_query_raises_is_never_queried_in_a_step(monkeypatch, caplog):
    nvml = fake_pynvml(0, query_raises=True)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    with caplog.at_level(logging.INFO, logger="engine.policy.device_monitor"):
        monitor = make_monitor(CUDA, _Knee())
    assert isinstance(monitor, KneeMonitor)
    policy = _policy(monitor)
    for _ in range(5):
        assert _decide(policy, 2) == [(4, "fixed")] * 2  # no raise inside a step
    assert nvml.queries == 0
    assert len([r for r in caplog.records if r.name == "engine.policy.device_monitor"]) <= 1


def test_the_nvml_reader_probes_once_at_start(monkeypatch, caplog):
    nvml = fake_pynvml(0, query_raises=True)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    with pytest.raises(RuntimeError, match="Not Supported"):
        NvmlMonitor(0)  # the probe: a MIG instance fails here, at start
    assert nvml.queries == 1


def test_the_nvml_reader_never_raises_after_start(monkeypatch, caplog):
    nvml = fake_pynvml(40)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    reader = NvmlMonitor(0, interval=0.0)
    assert nvml.queries == 1  # probed once
    assert reader.utilization(0) == pytest.approx(0.4)
    nvml.nvmlDeviceGetUtilizationRates = lambda handle: (_ for _ in ()).throw(NVMLError("lost"))
    with caplog.at_level(logging.WARNING, logger="engine.policy.device_monitor"):
        for _ in range(3):
            assert reader.utilization(0) == pytest.approx(0.4)  # the last reading, no raise
    assert len(caplog.records) == 1  # one line, then the reader stops asking
