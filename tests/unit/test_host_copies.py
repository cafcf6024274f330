"""Every host-to-device copy of an eager step's metadata goes through `to_device` (issue 33, F10).

`to_device` stages host data in pinned memory and copies it without blocking; a bare
`.to(device)` of a host tensor, a `torch.tensor(..., device=cuda)` or indexing a device tensor
with a Python list copies from pageable memory, which waits for the device. Checked on CPU by
running the eager step path (`ModelRunner.forward`, the backends' `build_metadata`) for the meta
device, a device other than the host on every machine: a torch function mode sees every op,
so any data that moves from the host to it outside `to_device` (here replaced by a fake that
marks its own copies) is recorded.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest
import torch
from torch.overrides import TorchFunctionMode

import engine.runtime.device
from engine.attention.base import flatten_step
from engine.attention.flash_attn import FlashAttentionBackend
from engine.attention.torch_attn import TorchAttentionBackend
from engine.core.chunks import SeqChunk
from engine.execution.runner import ModelRunner
from engine.runtime.device import Device

META = torch.device("meta")
BLOCK = 256  # flash-attn's page size; the torch backend takes any


def _not_called(*args, **kwargs):
    raise AssertionError("build_metadata only: no attention runs here")


BACKENDS = {
    "torch": TorchAttentionBackend,
    "flash_attn": lambda: FlashAttentionBackend(_not_called),
}


def _tensors(value: object) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _is_host_index(value: object) -> bool:
    """A Python list of ints (or a tuple holding one): torch copies it to the indexed tensor's
    device from pageable memory."""
    if isinstance(value, tuple):
        return any(_is_host_index(v) for v in value)
    return isinstance(value, list)


def _target_device(args: tuple, kwargs: dict) -> torch.device | None:
    """Where a `Tensor.to` call sends its tensor, if it names a device."""
    for value in (*args[1:], kwargs.get("device")):
        if isinstance(value, (torch.device, str)):
            return torch.device(value)
        if isinstance(value, torch.Tensor):
            return value.device
    return None


def bare_copy(name: str, args: tuple, kwargs: dict) -> str | None:
    """Why this op copies host data to a device outside to_device, or None."""
    tensors = list(_tensors(args)) + list(_tensors(list(kwargs.values())))
    on_device = [t for t in tensors if t.device.type != "cpu"]
    if name == "to" and args[0].device.type == "cpu":
        target = _target_device(args, kwargs)
        if target is not None and target.type != "cpu":
            return "Tensor.to(device) of a host tensor"
    if name in ("tensor", "as_tensor"):
        device = kwargs.get("device")
        if device is not None and torch.device(device).type != "cpu":
            return f"torch.{name}(..., device={device})"
    if on_device and name in ("__getitem__", "__setitem__") and _is_host_index(args[1]):
        return f"Tensor.{name} of a device tensor with a Python list"
    if on_device and any(t.device.type == "cpu" and t.dim() > 0 for t in tensors):
        return f"{name} mixes host and device tensors"
    return None


class HostCopyRecorder(TorchFunctionMode):
    """Records every host-to-device copy made outside the (fake) to_device."""

    def __init__(self) -> None:
        super().__init__()
        self.bare: list[str] = []
        self.num_helper_copies = 0
        self._in_helper = False

    def to_device(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Stands in for engine.runtime.device.to_device: the same copy, counted as the helper's."""
        self.num_helper_copies += 1
        self._in_helper = True
        try:
            return host.to(device)
        finally:
            self._in_helper = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self._in_helper:
            why = bare_copy(getattr(func, "__name__", ""), args, kwargs)
            if why is not None:
                self.bare.append(why)
        return func(*args, **kwargs)


@pytest.fixture
def recorder(monkeypatch) -> HostCopyRecorder:
    """A recorder whose to_device replaces engine.runtime.device.to_device wherever engine imported it."""
    recorder = HostCopyRecorder()
    real = engine.runtime.device.to_device
    for name, module in list(sys.modules.items()):
        if name.startswith("engine") and getattr(module, "to_device", None) is real:
            monkeypatch.setattr(module, "to_device", recorder.to_device)
    return recorder


def _chunks() -> list[SeqChunk]:
    """A prompt chunk after cached context, a decode row and a verify chunk: all three paths."""
    return [
        SeqChunk(list(range(5, 25)), 300, [3, 1], 1),
        SeqChunk([7], 40, [2], 1),
        SeqChunk([8, 9, 10, 11], 600, [0, 4, 5], 4),
    ]


@pytest.mark.parametrize("backend_name", list(BACKENDS))
def test_build_metadata_copies_to_the_device_only_through_to_device(recorder, backend_name):
    backend = BACKENDS[backend_name]()
    layout = flatten_step(_chunks(), BLOCK).layout
    with recorder:
        backend.build_metadata(layout, META)
    assert recorder.bare == []
    assert recorder.num_helper_copies > 0


class _FakeModel:
    """Returns each token's id as its hidden state and its logits: the rows a forward picks are
    visible in its output."""

    def __call__(self, ids: torch.Tensor, ctx: object) -> torch.Tensor:
        return ids[:, None].to(torch.float32)  # [num_tokens, 1]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden


def _runner(device: str, backend_name: str) -> ModelRunner:
    """A ModelRunner around the fake model: forward's own code, no weights."""
    runner = object.__new__(ModelRunner)
    runner.graphs = None
    runner.block_size = BLOCK
    runner.device = Device(device)
    runner.dtype = torch.float32
    runner.rope = lambda positions, dtype: (positions, positions)
    runner.backend = BACKENDS[backend_name]()
    runner.kv_caches = ()
    runner.model = _FakeModel()
    return runner


@pytest.mark.parametrize("backend_name", list(BACKENDS))
def test_an_eager_forward_copies_to_the_device_only_through_to_device(recorder, backend_name):
    with recorder:
        logits = _runner("meta", backend_name).forward(_chunks())
    assert recorder.bare == []
    assert logits is not None and logits.device.type == "meta" and logits.shape == (6, 1)


def test_the_recorder_sees_each_kind_of_bare_copy(recorder):
    """The faults the check exists for are caught (so the tests above can fail)."""
    host = torch.arange(4, device="cpu")
    on_device = torch.zeros(4, 2, device=META)
    with recorder:
        host.to(META)
        torch.tensor([1, 2], device=META)
        on_device[[0, 2]]
        on_device.index_select(0, host)
    assert len(recorder.bare) == 4, recorder.bare


@pytest.mark.parametrize("backend_name", list(BACKENDS))
def test_an_eager_forward_returns_the_logit_rows_in_order(backend_name):
    """On CPU the forward's output is unchanged: the rows asked for, in chunk order (the last
    token of the prompt chunk, the decode row, all four verify rows)."""
    logits = _runner("cpu", backend_name).forward(_chunks())
    assert logits is not None
    assert logits[:, 0].tolist() == [24.0, 7.0, 8.0, 9.0, 10.0, 11.0]


def test_flash_metadata_values_are_unchanged():
    meta = FlashAttentionBackend(_not_called).build_metadata(
        flatten_step(_chunks(), BLOCK).layout, torch.device("cpu")
    )
    assert meta.cu_seqlens_q.tolist() == [0, 20, 21, 25]
    assert meta.cu_seqlens_k.tolist() == [0, 320, 361, 965]
    assert (meta.max_seqlen_q, meta.max_seqlen_k) == (20, 604)
    assert meta.block_table.tolist() == [[3, 1, 0], [2, 0, 0], [0, 4, 5]]
    slots = meta.slot_mapping.tolist()  # position p of a chunk: block p // 256, offset p % 256
    assert slots == [BLOCK + 44 + i for i in range(20)] + [
        2 * BLOCK + 40,
        *[5 * BLOCK + 88 + i for i in range(4)],
    ]
