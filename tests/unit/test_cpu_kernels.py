"""engine/kernels: the AVX2 bfloat16 linear against a float64 reference, and the dispatch that
sends decode-shaped bfloat16 linears to it (and everything else, or everything when it cannot be
built, to torch)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import engine.kernels as kernels
from engine.models import llama

needs_kernels = pytest.mark.skipif(
    kernels.unavailable_reason() is not None, reason=str(kernels.unavailable_reason())
)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 16, 19])
@pytest.mark.parametrize(("out_features", "in_features"), [(1, 8), (7, 13), (33, 64), (130, 203)])
def test_bf16_linear_matches_float64(rows, out_features, in_features):
    module = kernels.cpu_kernels()
    assert module is not None
    gen = torch.Generator(device="cpu").manual_seed(rows * 1000 + out_features)
    weight = torch.randn(out_features, in_features, generator=gen, device="cpu").bfloat16()
    bias = torch.randn(out_features, generator=gen, device="cpu").bfloat16()
    x = torch.randn(rows, in_features, generator=gen, device="cpu")
    ref = x.double() @ weight.double().t()  # [rows, out_features]
    out = module.bf16_linear(x, weight, None)
    assert out.dtype == torch.float32 and out.shape == (rows, out_features)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    with_bias = module.bf16_linear(x.bfloat16(), weight, bias)
    assert with_bias.dtype == torch.bfloat16
    ref_bias = x.bfloat16().double() @ weight.double().t() + bias.double()
    torch.testing.assert_close(with_bias.double(), ref_bias, rtol=1e-2, atol=1e-2)


@needs_kernels
def test_bf16_linear_refuses_what_it_cannot_compute():
    module = kernels.cpu_kernels()
    with pytest.raises(RuntimeError, match="bfloat16"):
        module.bf16_linear(torch.randn(2, 8), torch.randn(4, 8), None)
    with pytest.raises(RuntimeError, match="contiguous"):
        module.bf16_linear(torch.randn(2, 8), torch.randn(8, 4).bfloat16().t(), None)
    with pytest.raises(RuntimeError, match=r"\[M, K\]"):
        module.bf16_linear(torch.randn(2, 7), torch.randn(4, 8).bfloat16(), None)


def _spy(monkeypatch) -> list[int]:
    calls: list[int] = []

    class Spy:
        @staticmethod
        def bf16_linear(x, weight, bias):
            calls.append(x.shape[0])
            return F.linear(x, weight, bias)

    monkeypatch.setattr(llama, "cpu_kernels", lambda: Spy)
    return calls


@pytest.mark.parametrize(
    ("measured_limit", "expected"), [(16, [1, 4, 16]), (1 << 62, [1, 4, 16, 17, 64])]
)
def test_decode_shaped_bf16_linears_go_to_the_kernel(monkeypatch, measured_limit, expected):
    """Decode and verify shapes always; prefill shapes where the kernel measured faster."""
    calls = _spy(monkeypatch)
    monkeypatch.setattr(llama, "max_kernel_rows", lambda weight: measured_limit)
    weight = torch.randn(16, 32).bfloat16()
    for rows in (1, 4, llama.ALWAYS_ROWS, llama.ALWAYS_ROWS + 1, 64):
        llama.linear(torch.randn(rows, 32).bfloat16(), weight)
    llama.linear(torch.randn(3, 32), torch.randn(16, 32))  # float32: torch
    assert calls == expected


@needs_kernels
def test_the_prefill_choice_is_measured_once(monkeypatch):
    monkeypatch.setattr(kernels, "_loaded", {"module": kernels.cpu_kernels()})
    weight = torch.randn(256, 512).bfloat16()
    limit = kernels.max_kernel_rows(weight)
    assert limit in (kernels.ALWAYS_ROWS, 1 << 62)
    monkeypatch.setattr(kernels, "_best_seconds", lambda fn: pytest.fail("measured twice"))
    assert kernels.max_kernel_rows(weight) == limit


def test_without_the_kernel_torch_computes_the_same(monkeypatch):
    monkeypatch.setattr(llama, "cpu_kernels", lambda: None)
    weight, bias = torch.randn(16, 32).bfloat16(), torch.randn(16).bfloat16()
    for rows in (1, 3):
        x = torch.randn(rows, 32).bfloat16()
        ref = x.double() @ weight.double().t() + bias.double()
        out = llama.linear(x, weight, bias)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)


def test_turned_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("SPECSERVE_CPU_KERNELS", "0")
    monkeypatch.setattr(kernels, "_loaded", {})
    assert "SPECSERVE_CPU_KERNELS" in str(kernels.unavailable_reason())
    assert kernels.cpu_kernels() is None


@needs_kernels
def test_a_build_killed_midway_does_not_hang_the_next_start(tmp_path):
    """torch's builder leaves a `lock` file behind when its process dies mid-build, and waits on
    it forever in every later process; the next start must clear it and load."""
    module = kernels.cpu_kernels()  # built (or loaded) here first
    build_dir = Path(module.__file__).parent
    (build_dir / "lock").touch()
    script = "import engine.kernels as k; assert k.cpu_kernels() is not None; print('loaded')"
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "loaded" in done.stdout
    assert not (build_dir / "lock").exists()
