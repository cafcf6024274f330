"""CUDA events, streams and fences name the engine's device (issue 33, F9).

`torch.cuda.Event()`, `Event.record()` without a stream, `torch.cuda.current_stream()` and
`torch.cuda.synchronize()` without a device act on the calling thread's current device. The
engine is built on a loader thread and stepped on its own thread, neither of which sets it, so
on `cuda:1` they timed and fenced cuda:0. This reads engine/ and fails on any such use that
neither names the device nor sits inside `with torch.cuda.device(...)`.
"""

from __future__ import annotations

import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[2] / "engine"
# torch.cuda functions that act on the current device unless given one (positionally or as
# device=), and those that take no device at all: only a device context places them.
TAKES_DEVICE = {"Stream", "current_stream", "default_stream", "synchronize", "set_stream"}
NEEDS_CONTEXT = {"Event", "CUDAGraph", "graph", "ExternalStream"}


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def _is_device_context(item: ast.withitem) -> bool:
    expr = item.context_expr
    return isinstance(expr, ast.Call) and _dotted(expr.func) == "torch.cuda.device"


def _names_device(call: ast.Call) -> bool:
    return bool(call.args) or any(kw.arg in ("device", "stream") for kw in call.keywords)


def undevice_uses(source: str, filename: str) -> list[str]:
    """`file:line name` of each current-device CUDA use in `source` outside a device context."""
    found: list[str] = []

    def visit(node: ast.AST, in_context: bool) -> None:
        if isinstance(node, ast.With | ast.AsyncWith):
            in_context = in_context or any(_is_device_context(i) for i in node.items)
        if isinstance(node, ast.Call) and not in_context:
            name = _dotted(node.func)
            short = name.removeprefix("torch.cuda.")
            if name.startswith("torch.cuda.") and (
                short in NEEDS_CONTEXT or (short in TAKES_DEVICE and not _names_device(node))
            ):
                found.append(f"{filename}:{node.lineno} {name}")
            # event.record() with no stream records on the current device's current stream.
            elif (
                isinstance(node.func, ast.Attribute)
                and node.func.attr == "record"
                and not _names_device(node)
            ):
                found.append(f"{filename}:{node.lineno} .record()")
        for child in ast.iter_child_nodes(node):
            visit(child, in_context)

    visit(ast.parse(source, filename), False)
    return found


def test_engine_cuda_uses_name_the_device():
    files = sorted(ENGINE.rglob("*.py"))
    assert any(f.name == "cuda_graphs.py" for f in files)
    found = [
        use
        for f in files
        for use in undevice_uses(f.read_text(), str(f.relative_to(ENGINE.parent)))
    ]
    assert found == [], f"CUDA uses on the thread's current device: {found}"


def test_the_check_tells_placed_uses_from_unplaced_ones():
    source = """
import torch

def unplaced(dev):
    e = torch.cuda.Event(enable_timing=True)
    e.record()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()

def placed(dev, s):
    with torch.cuda.device(dev):
        e = torch.cuda.Event(enable_timing=True)
        e.record()
    e.record(torch.cuda.current_stream(dev))
    torch.cuda.synchronize(dev)
    s = torch.cuda.Stream(device=dev)
    stats.record(3, 4)
"""
    assert undevice_uses(source, "x.py") == [
        "x.py:5 torch.cuda.Event",
        "x.py:6 .record()",
        "x.py:7 torch.cuda.current_stream",
        "x.py:8 torch.cuda.synchronize",
    ]


class FakeCuda:
    """The torch.cuda calls Device and CudaCaptureDevice make, recording on which device each
    ran: the device a `torch.cuda.device` context entered, or the one it was given."""

    def __init__(self) -> None:
        self.current = 0  # the thread's current device, as CUDA keeps it
        self.calls: list[tuple[str, object]] = []

    def install(self, monkeypatch) -> None:
        import contextlib

        import torch

        fake = self

        @contextlib.contextmanager
        def device(dev):
            before, fake.current = fake.current, torch.device(dev).index
            try:
                yield
            finally:
                fake.current = before

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                fake.calls.append(("Event", fake.current))

            def record(self, stream=None) -> None:
                fake.calls.append(("record", stream.device if stream else fake.current))

            def synchronize(self) -> None:
                pass

        class Stream:
            def __init__(self, device=None) -> None:
                self.device = torch.device(device).index if device is not None else fake.current

            def wait_stream(self, other) -> None:
                fake.calls.append(("wait_stream", (self.device, other.device)))

        def current_stream(device=None):
            return Stream(device if device is not None else fake.current)

        class CUDAGraph:
            def __init__(self) -> None:
                fake.calls.append(("CUDAGraph", fake.current))

        @contextlib.contextmanager
        def graph(g, pool=None, stream=None):
            fake.calls.append(("graph", fake.current))
            yield

        @contextlib.contextmanager
        def stream(s):
            yield

        for name, value in dict(
            device=device,
            Event=Event,
            Stream=Stream,
            current_stream=current_stream,
            CUDAGraph=CUDAGraph,
            graph=graph,
            stream=stream,
            graph_pool_handle=lambda: (0, 1),
        ).items():
            monkeypatch.setattr(torch.cuda, name, value)


def test_marks_and_fences_run_on_the_engine_device_not_the_current_one(monkeypatch):
    import torch

    from engine.execution.cuda_graphs import CudaCaptureDevice
    from engine.runtime.device import Device

    fake = FakeCuda()
    fake.install(monkeypatch)
    device = Device(torch.device("cuda", 1))  # the thread's current device stays 0
    device.mark()
    capture = CudaCaptureDevice(device.torch, num_warmups=1)
    capture.copies_queued()
    capture.capture(lambda: torch.zeros(1))
    assert fake.current == 0
    assert fake.calls == [
        ("Event", 1),
        ("record", 1),
        ("Event", 1),
        ("record", 1),
        ("wait_stream", (1, 1)),
        ("wait_stream", (1, 1)),
        ("CUDAGraph", 1),
        ("graph", 1),
    ]
