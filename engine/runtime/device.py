"""The device a model runs on, as one small object the engine asks instead of torch directly.

It owns the four things that differ between a CPU and a GPU and that the engine must get right
on both: where tensors and generators are created (`tensor`, `generator`), how host data gets
there (`to_device`: pinned memory and a non-blocking copy on CUDA, nothing on CPU), how a timing
measures work (a CUDA kernel launch returns before the kernel runs, so a host clock read without
a synchronisation measures launches: `mark` records a CUDA event in the stream, `elapsed` reads
the time between two once the step's single `synchronize` has passed them), and how much memory
there is (`memory_info`). Tests replace it with a fake that counts synchronisations, scripts the
clock and reports a chosen amount of memory, so the GPU rules are checked on CPU.

Host data always starts on the host (`torch.tensor(..., device="cpu")`) and moves with
`to_device`; every other tensor factory in engine/ names the device it creates on. A test reads
the source to hold engine/ to both rules.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

import torch

T = TypeVar("T")


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`: the one way a step's host data (token ids, positions, slots,
    block tables, row indices) reaches the device. On CPU: the tensor itself.

    On CUDA the values are staged in pinned memory and copied without blocking the host (a copy
    from pageable memory would wait for the device). Why nothing needs to wait for that copy:
    - its readers: it is queued on the current stream, and the kernels that read the result are
      queued after it on the same stream, so they run once it is done;
    - its source: the staging tensor is a fresh block of torch's caching host allocator, never a
      buffer reused from step to step. torch's non-blocking copy records an event for that block
      on the copying stream, and the allocator hands the block out again only once the event has
      passed, so dropping the staging tensor on return cannot let a later step's staging
      overwrite it while this copy may still read it;
    - `host` itself is read only by the host-side copy into the staging block, done before this
      returns: the caller may change or free it at once (even when `host` is pinned itself).
    A pinned buffer that IS reused (the CUDA graphs' metadata mirrors) needs a fence of its own
    before it is rewritten (engine.execution.cuda_graphs)."""
    if device.type != "cuda":
        return host
    staged = torch.empty(host.shape, dtype=host.dtype, device="cpu", pin_memory=True)
    staged.copy_(host)
    return staged.to(device, non_blocking=True)


def to_host(values: torch.Tensor) -> torch.Tensor:
    """A device tensor's values on the host, copied without blocking: on CUDA a pinned tensor
    that holds them once the device has passed a mark recorded after this call (read it only
    after `Device.wait` on such a mark); on CPU the tensor itself."""
    if values.device.type != "cuda":
        return values
    host = torch.empty(values.shape, dtype=values.dtype, device="cpu", pin_memory=True)
    host.copy_(values, non_blocking=True)
    return host


class Device:
    """One torch device and the rules for using it."""

    def __init__(self, device: torch.device | str) -> None:
        self.torch = torch.device(device)
        if self.torch.type == "cuda" and self.torch.index is None:
            self.torch = torch.device("cuda", torch.cuda.current_device())
        self.num_synchronizations = 0

    @property
    def type(self) -> str:
        return self.torch.type

    @property
    def is_cuda(self) -> bool:
        return self.torch.type == "cuda"

    def synchronize(self) -> None:
        """Wait for the work queued on the device (a no-op on CPU, where ops run when called)."""
        self.num_synchronizations += 1
        if self.is_cuda:
            torch.cuda.synchronize(self.torch)

    def wait(self, mark: Any) -> None:
        """Wait until the device work queued before `mark` is done, and no more (the work queued
        after it, an overlapped step's next one, keeps running): one synchronisation."""
        self.num_synchronizations += 1
        if self.is_cuda:
            mark.synchronize()

    def launch(self, work: Callable[[], T]) -> Future[T]:
        """Queue a step's device work: `work` launches its kernels (on CUDA they run after the
        host returns) and returns its outputs, device tensors whose values may not exist yet;
        read them after `wait` on a mark the work recorded. Here the work is called at once; a
        test's fake runs it on a thread of its own, a device stream the host does not wait for."""
        future: Future[T] = Future()
        future.set_result(work())
        return future

    def now(self) -> float:
        """perf_counter() once the device's queued work is done (start-up timings)."""
        self.synchronize()
        return time.perf_counter()

    def mark(self) -> Any:
        """A point in the device's work: a CUDA event recorded in this device's current stream
        (it completes when the work queued before it does), or the host clock on CPU. The
        device is named, not taken from the calling thread (whose current device is cuda:0
        unless set: the engine's threads never set it)."""
        if not self.is_cuda:
            return time.perf_counter()
        with torch.cuda.device(self.torch):
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.torch))
        return event

    def elapsed(self, start: Any, end: Any) -> float:
        """Seconds of device work between two marks. On CUDA both must have completed: read
        after a `synchronize` that follows them (this never waits on its own)."""
        if not self.is_cuda:
            return float(end - start)
        return float(start.elapsed_time(end)) / 1e3

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """A host tensor on this device (see `to_device`)."""
        return to_device(host, self.torch)

    def tensor(self, data: Sequence[int] | Sequence[float], dtype: torch.dtype) -> torch.Tensor:
        """A tensor of host values on this device (built on the host, copied as `to_device`)."""
        return self.to_device(torch.tensor(data, dtype=dtype, device="cpu"))

    def generator(self, seed: int) -> torch.Generator:
        """A generator on this device, seeded: draws for this device's tensors must come from
        one (torch refuses a CPU generator for a CUDA tensor)."""
        generator = torch.Generator(device=self.torch)
        generator.manual_seed(seed)
        return generator

    def memory_info(self) -> tuple[int, int] | None:
        """(free, total) bytes of device memory, or None where the device does not say (CPU)."""
        if not self.is_cuda:
            return None
        free, total = torch.cuda.mem_get_info(self.torch)
        return int(free), int(total)

    def __repr__(self) -> str:
        return f"Device({self.torch})"
