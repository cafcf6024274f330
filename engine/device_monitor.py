"""How busy the device is, for the `spec_disable_utilization` operator limit.

On a GPU, NVML's utilization (the share of the last sample period a kernel ran), read at most every
`interval` seconds through nvidia-ml-py (`pynvml`, imported lazily). On CPU nothing reports a
useful figure, so the calibrated step-time model stands in: a step's utilization is its query
tokens over the compute-bound knee (1.0 once the step would be compute-bound without drafts).
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
    """CPU: step tokens over the compute-bound knee of the step-time model."""

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
    """GPU: NVML utilization of one device (torch's numbering), cached for `interval` seconds."""

    def __init__(self, device_index: int = 0, interval: float = 0.1) -> None:
        import pynvml  # nvidia-ml-py, part of the gpu extra

        pynvml.nvmlInit()
        self._nvml = pynvml
        name = nvml_device(device_index)
        if isinstance(name, int):
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(name)
        else:
            self._handle = pynvml.nvmlDeviceGetHandleByUUID(name)
        self.interval = interval
        self._value = 0.0
        self._read_at = -float("inf")

    def utilization(self, num_step_tokens: int) -> float:
        now = time.monotonic()
        if now - self._read_at >= self.interval:
            rates = self._nvml.nvmlDeviceGetUtilizationRates(self._handle)
            self._value = rates.gpu / 100.0
            self._read_at = now
        return self._value


def make_monitor(device: torch.device, step_model: Any) -> DeviceMonitor:
    """NVML on CUDA devices when it loads, the knee stand-in otherwise."""
    if device.type == "cuda":
        try:
            return NvmlMonitor(device.index or 0)
        except Exception as e:  # no pynvml or no driver access: fall back, say why
            logger.warning("NVML unavailable (%s); utilization from the step-time knee", e)
    return KneeMonitor(step_model)
