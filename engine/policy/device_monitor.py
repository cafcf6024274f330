"""How busy the device is, for the `spec_disable_utilization` operator limit.

The limit means "the step is compute-bound: drafts would no longer ride for free". On every
device that is judged from the calibrated step-time model: a step's utilization is its query
tokens over the compute-bound knee (1.0 once the step would be compute-bound without drafts).

NVML does not answer that question. Its "gpu" utilization is the share of the last sample period
during which any kernel ran: an engine that steps continuously reads ~100% at batch 1 as at batch
64, so the limit turned speculation off at every load. SM activity (GPM, Hopper and later) is no
better: a memory-bound decode GEMV keeps every SM occupied. And on a MIG instance the query raises
NOT_SUPPORTED. `NvmlMonitor` stays as a reader of that kernel-time share for checks and reports:
it queries once when built (a device that does not answer fails there, at start) and never
raises afterwards.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from typing import Any, Protocol

import torch

logger = logging.getLogger(__name__)


class DeviceMonitor(Protocol):
    """Utilization in [0, 1] for a step that computes num_step_tokens before any drafts."""

    def utilization(self, num_step_tokens: int) -> float: ...


class KneeMonitor:
    """Step tokens over the compute-bound knee of the step-time model (CPU and GPU)."""

    def __init__(self, step_model: Any) -> None:
        self.step_model = step_model  # anything with a `knee` attribute (StepTimeModel)

    def utilization(self, num_step_tokens: int) -> float:
        return min(1.0, num_step_tokens / max(1, self.step_model.knee))


def nvml_device(cuda_index: int, environ: Mapping[str, str] | None = None) -> int | str:
    """The NVML name of CUDA device `cuda_index` as torch numbers it: an NVML index, or a UUID.

    torch counts only the devices CUDA_VISIBLE_DEVICES lets it see, in the order it lists them;
    NVML counts every device on the node. With CUDA_VISIBLE_DEVICES=2,3 torch's cuda:0 is NVML
    device 2; entries may also be UUIDs (GPU-..., MIG-...), which NVML looks up by UUID."""
    environ = os.environ if environ is None else environ
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None or not visible.strip():
        return cuda_index
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if cuda_index >= len(entries):
        raise ValueError(f"cuda:{cuda_index} is not among CUDA_VISIBLE_DEVICES={visible!r}.")
    entry = entries[cuda_index]
    return int(entry) if entry.isdigit() else entry


class NvmlMonitor:
    """NVML's kernel-time utilization of one device (torch's numbering), cached for `interval`
    seconds. Not a compute-bound signal (see the module docstring), so `make_monitor` never
    picks it. Built: NVML answered once (the probe); after that `utilization` never raises."""

    def __init__(self, device_index: int = 0, interval: float = 0.1) -> None:
        import pynvml  # nvidia-ml-py, part of the gpu extra

        self._nvml = pynvml
        try:
            pynvml.nvmlInit()
            name = nvml_device(device_index)
            if isinstance(name, int):
                self._handle = pynvml.nvmlDeviceGetHandleByIndex(name)
            else:
                self._handle = pynvml.nvmlDeviceGetHandleByUUID(name)
            rates = pynvml.nvmlDeviceGetUtilizationRates(self._handle)  # the probe
        except Exception as e:  # no driver access, or a MIG instance (NOT_SUPPORTED)
            raise RuntimeError(f"NVML utilization of cuda:{device_index}: {e}") from e
        self.interval = interval
        self._value = rates.gpu / 100.0
        self._read_at = time.monotonic()
        self._is_lost = False

    def utilization(self, num_step_tokens: int) -> float:
        now = time.monotonic()
        if not self._is_lost and now - self._read_at >= self.interval:
            try:
                rates = self._nvml.nvmlDeviceGetUtilizationRates(self._handle)
            except Exception as e:  # never inside a step: keep the last reading, stop asking
                self._is_lost = True
                logger.warning("NVML utilization query failed (%s); keeping %.2f", e, self._value)
                return self._value
            self._value = rates.gpu / 100.0
            self._read_at = now
        return self._value


def make_monitor(device: torch.device, step_model: Any) -> DeviceMonitor:
    """The step-time knee on every device: NVML's kernel-time share would read every stepping
    engine as busy (module docstring). Nothing here queries the device, so nothing can fail in
    a step."""
    if device.type == "cuda":
        logger.info("spec_disable_utilization on %s: step tokens over the step-time knee", device)
    return KneeMonitor(step_model)
