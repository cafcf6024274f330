"""The NVML device monitor on CUDA (skipped without a GPU), and the CPU stand-in everywhere."""

from __future__ import annotations

import time

import pytest
import torch

from engine.policy.device_monitor import KneeMonitor, NvmlMonitor, make_monitor


class _Knee:
    knee = 8


def test_cpu_monitor_is_step_tokens_over_the_knee() -> None:
    monitor = make_monitor(torch.device("cpu"), _Knee())
    assert isinstance(monitor, KneeMonitor)
    assert monitor.utilization(2) == 0.25
    assert monitor.utilization(8) == 1.0
    assert monitor.utilization(64) == 1.0  # capped


@pytest.mark.gpu
@pytest.mark.gpu_check("NVML utilization monitor")
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_nvml_reports_a_busy_gpu() -> None:
    pytest.importorskip("pynvml")
    # The engine judges load by the knee on CUDA too (NVML's share counts any kernel running);
    # NVML's reader stays for reports, and must still read a busy GPU.
    assert isinstance(make_monitor(torch.device("cuda"), _Knee()), KneeMonitor)
    monitor = NvmlMonitor(0)
    monitor.interval = 0.0
    idle = monitor.utilization(0)
    assert 0.0 <= idle <= 1.0
    x = torch.randn(8192, 8192, device="cuda")
    busy = 0.0
    # Kernel launches return at once: wait for each product, and keep the GPU busy for a few of
    # NVML's sample periods (1/6 s to 1 s, by GPU) while reading it.
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline and busy <= 0.5:
        for _ in range(4):
            x = x @ x
            x = x / x.norm()
        torch.cuda.synchronize()
        busy = max(busy, monitor.utilization(0))
    assert busy > 0.5
