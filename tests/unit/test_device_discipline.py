"""The GPU path's device rules, checked on CPU.

1. Every tensor factory and generator in engine/ names the device it creates on, and host data is
   built on the host and moved with `to_device` (pinned, non-blocking on CUDA): read from the
   source, so a factory that would silently land on the CPU next to CUDA logits fails here.
2. Sampling makes no torch generator: its draws come from counter keys on the logits' device
   (a CPU generator next to CUDA logits killed the engine on the first sampled request).
3. The timings the policy learns from are device time between marks, read after the step's one
   synchronisation; nothing else in a step synchronises.
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.policy.device_monitor import nvml_device
from engine.runtime.device import Device, to_device
from tests.conftest import build_tiny_model

ENGINE = Path(__file__).resolve().parents[2] / "engine"

# torch functions that create a tensor or generator from nothing (the *_like ones inherit the
# device of their argument, and so do methods of existing tensors).
FACTORIES = {
    "tensor",
    "as_tensor",
    "zeros",
    "ones",
    "empty",
    "full",
    "arange",
    "rand",
    "randn",
    "randint",
    "randperm",
    "linspace",
    "logspace",
    "eye",
    "empty_strided",
    "scalar_tensor",
    "tril_indices",
    "triu_indices",
    "Generator",
}
HOST_DATA = {"tensor", "as_tensor"}  # built from Python values: on the host, then to_device


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def device_violations(source: str, filename: str = "<source>") -> list[str]:
    """Every torch factory call in `source` that breaks the rules, as 'file:line: why'."""
    problems = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in ("cuda", "cpu") and not node.args:
            problems.append(f"{filename}:{node.lineno}: .{func.attr}() picks a device by hand")
            continue
        if not (
            isinstance(func, ast.Attribute)
            and isinstance(func.value, ast.Name)
            and func.value.id == "torch"
            and func.attr in FACTORIES | {"from_numpy"}
        ):
            continue
        where = f"{filename}:{node.lineno}: torch.{func.attr}"
        device = _keyword(node, "device")
        is_cpu = isinstance(device, ast.Constant) and device.value == "cpu"
        if func.attr == "from_numpy":
            problems.append(f"{where} has no device: use torch.tensor(..., device='cpu')")
        elif device is None:
            problems.append(f"{where} does not name its device")
        elif func.attr in HOST_DATA and not is_cpu:
            problems.append(f"{where}: host data goes device='cpu', then to_device()")
        elif func.attr == "Generator" and is_cpu:
            problems.append(f"{where}: a generator lives on the device of what it draws for")
    return problems


def test_engine_names_the_device_of_every_tensor_and_generator():
    problems = []
    for path in sorted(ENGINE.rglob("*.py")):
        problems += device_violations(path.read_text(), str(path.relative_to(ENGINE.parent)))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    "line",
    [
        "g = torch.Generator()",  # the original fault: a CPU generator for CUDA logits
        "g = torch.Generator(device='cpu')",
        "x = torch.zeros(3)",
        "x = torch.tensor([1, 2], device=logits.device)",  # a blocking pageable copy
        "x = torch.from_numpy(a)",
        "x = y.cuda()",
    ],
)
def test_the_source_check_catches_each_kind_of_fault(line):
    assert len(device_violations(line)) == 1


@pytest.mark.parametrize(
    "line",
    [
        "g = torch.Generator(device=logits.device)",
        "x = torch.zeros(3, device=device)",
        "x = to_device(torch.tensor([1, 2], device='cpu'), device)",
        "x = torch.zeros_like(y)",
    ],
)
def test_the_source_check_accepts_the_rules(line):
    assert device_violations(line) == []


def test_to_device_on_cpu_is_the_tensor_itself():
    host = torch.arange(4, device="cpu")
    assert to_device(host, torch.device("cpu")) is host
    assert Device("cpu").tensor([1, 2], torch.int64).tolist() == [1, 2]


# ------------------------------------------------------------------------------ generators


def test_sampling_makes_no_generator(tiny_llama, monkeypatch):
    """Sampling, verifying and drafting make no torch generator at all (a bare torch.Generator()
    is a CPU generator, fatal next to CUDA logits; and one per row costs a launch per row):
    every draw comes from counter keys (`engine/sampling/counter_rng.py`) on the logits' device."""
    made: list[object] = []
    real = torch.Generator

    def recording_generator(*args, **kwargs):
        made.append(kwargs.get("device", args[0] if args else None))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "Generator", recording_generator)
    spec = {
        "method": "draft_model",
        "model": str(tiny_llama),
        "num_speculative_tokens": 3,
        "mode": "always",
        "draft_min_confidence": 0.0,
    }
    llm = LLM(str(tiny_llama), dtype="float32", speculative_config=spec)
    params = [
        SamplingParams(temperature=1.0, max_tokens=6, seed=3, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=6, ignore_eos=True),
    ]
    llm.generate([[5, 6, 7], [9, 10]], params)
    assert llm.engine.spec_stats.num_draft_tokens > 0  # the draft model sampled too
    assert made == []


# ------------------------------------------------------------------------------ timing


class FakeDevice(Device):
    """A CPU device whose clock is scripted (every mark advances it by `tick` seconds) and which
    counts synchronisations: stands in for a CUDA device whose events are read after a sync."""

    def __init__(self, tick: float) -> None:
        super().__init__("cpu")
        self._clock = itertools.count(step=tick)

    def mark(self) -> float:
        return float(next(self._clock))


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("draft"), "llama", seed=5, num_hidden_layers=1)


def test_policy_learns_device_time_with_one_synchronisation_per_step(tiny_llama, draft_dir):
    spec = {
        "method": "ngram+draft_model",
        "model": str(draft_dir),
        "num_speculative_tokens": 3,
        "mode": "always",
        "draft_min_confidence": 0.0,
        "prompt_lookup_min": 1,
    }
    llm = LLM(str(tiny_llama), dtype="float32", speculative_config=spec)
    engine = llm.engine
    target_device, draft_device = FakeDevice(tick=2.0), FakeDevice(tick=0.5)
    engine.runner.device = target_device
    draft = next(p for p in engine.speculator.chain if p.name == "draft_model")
    draft.runner.device = draft_device
    steps: list[float] = []
    drafts = []

    def observe(stats):  # what the policy learns from
        steps.append(stats.forward_seconds)
        if stats.draft_timing is not None:
            drafts.append(stats.draft_timing)

    engine.policy.observe = observe

    prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    num_steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        num_steps += 1

    # The step's forward is timed between two device marks, and only the device clock counts.
    assert steps == [2.0] * num_steps
    assert target_device.num_synchronizations == num_steps
    # The draft model's forwards are read from its marks after that synchronisation.
    assert drafts, "the draft model never drafted"
    assert all(t.first_seconds == 0.5 for t in drafts)
    assert all(t.more_seconds == 0.5 for t in drafts)
    assert draft_device.num_synchronizations == 0


# ------------------------------------------------------------------------------ NVML


@pytest.mark.parametrize(
    ("visible", "index", "expected"),
    [
        (None, 1, 1),  # every device visible: the same numbering
        ("", 0, 0),
        ("2,3", 0, 2),  # torch's cuda:0 is the node's device 2
        ("2,3", 1, 3),
        (" 3 , 1 ", 1, 1),
        (
            "GPU-8f6c1a2e-1111-2222-3333-444455556666,1",
            0,
            "GPU-8f6c1a2e-1111-2222-3333-444455556666",
        ),
        ("MIG-0a1b2c3d-4444-5555-6666-777788889999", 0, "MIG-0a1b2c3d-4444-5555-6666-777788889999"),
    ],
)
def test_nvml_follows_cuda_visible_devices(visible, index, expected):
    environ = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    assert nvml_device(index, environ) == expected


def test_nvml_refuses_a_device_cuda_cannot_see():
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES"):
        nvml_device(2, {"CUDA_VISIBLE_DEVICES": "0,1"})
