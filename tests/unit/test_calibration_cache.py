"""The step-time calibration's cache key: a fit is reused only where the same model runs the same
way on the same hardware, since every timing in it depends on all of these."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

from engine import kernels
from engine.speculation import calibration


def _runner(weight_format: str = "float32") -> SimpleNamespace:
    return SimpleNamespace(
        device=SimpleNamespace(torch=torch.device("cpu")),
        dtype=torch.float32,
        weight_format=weight_format,
        backend=SimpleNamespace(name="torch"),
        block_size=16,
    )


def _key(runner: SimpleNamespace, path: Path = Path("/models/a")) -> str:
    return calibration._cache_key(runner, path, 64, 2048)


def test_the_key_is_stable_for_one_setup():
    assert _key(_runner()) == _key(_runner())


def test_the_key_changes_with_what_changes_the_timings(monkeypatch):
    base = _key(_runner())
    assert _key(_runner("gguf (Q4_K), float32 activations")) != base
    int8 = _key(_runner("gguf (Q4_K), int8 activations"))
    assert int8 not in (base, _key(_runner("gguf (Q4_K), float32 activations")))
    assert _key(_runner(), Path("/models/b")) != base
    monkeypatch.setattr(calibration, "cpu_name", lambda: "another CPU")
    other_cpu = _key(_runner())
    assert other_cpu != base
    monkeypatch.setattr(kernels, "speed_signature", lambda: "other kernels")
    assert _key(_runner()) not in (base, other_cpu)


def test_the_cpu_is_named_by_its_model():
    name = calibration.cpu_name()
    assert name and name not in ("x86_64", "")  # not just the architecture where /proc says more
