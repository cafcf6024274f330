"""engine/kernels: the bfloat16 linear (AVX2, and AVX-512 BF16 where the CPU has it) and the
float32 one against a float64 reference, and the dispatch that sends every CPU bfloat16 and
float32 linear to them at any number of rows (to torch when they cannot be built)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import engine.kernels as kernels
from engine.models import linears

needs_kernels = pytest.mark.skipif(
    kernels.unavailable_reason() is not None, reason=str(kernels.unavailable_reason())
)


def _cpu_has_avx512_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return all(flag in flags for flag in ("avx512f", "avx512bw", "avx512vl", "avx512_bf16"))


ISAS = [
    "avx2",
    pytest.param(
        "avx512bf16",
        marks=pytest.mark.skipif(not _cpu_has_avx512_bf16(), reason="no AVX-512 BF16 here"),
    ),
]


@pytest.fixture(params=ISAS)
def isa(request):
    """The bfloat16 linear on each instruction set this CPU has, the process's own restored."""
    module = kernels.cpu_kernels()
    assert module is not None
    previous = module.set_cpu_isa(request.param)
    yield request.param
    module.set_cpu_isa(previous)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 16, 19])
@pytest.mark.parametrize(("out_features", "in_features"), [(1, 8), (7, 13), (33, 64), (130, 203)])
def test_bf16_linear_matches_float64(isa, rows, out_features, in_features):
    module = kernels.cpu_kernels()
    assert module is not None and module.cpu_isa() == isa
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
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bf16_linear_computes_a_row_alike_whatever_the_batch(isa, dtype):
    # A verify step's row must equal the decode step's for the same input (lossless speculation):
    # each output has one order of summation, whichever tile its row falls in.
    module = kernels.cpu_kernels()
    gen = torch.Generator(device="cpu").manual_seed(7)
    weight = torch.randn(37, 300, generator=gen, device="cpu").bfloat16()
    x = torch.randn(13, 300, generator=gen, device="cpu").to(dtype)
    together = module.bf16_linear(x, weight, None)
    for i in range(13):
        assert torch.equal(module.bf16_linear(x[i : i + 1], weight, None)[0], together[i])


@needs_kernels
def test_bf16_linear_float32_activations_are_used_exactly_on_avx512():
    """On the AVX-512 BF16 path float32 activations are split into three bfloat16 parts whose sum
    is exactly x: a product with a weight that is a power of two is then exact."""
    if not _cpu_has_avx512_bf16():
        pytest.skip("no AVX-512 BF16 here")
    module = kernels.cpu_kernels()
    previous = module.set_cpu_isa("avx512bf16")
    try:
        x = torch.randn(3, 64, generator=torch.Generator(device="cpu").manual_seed(1))
        weight = torch.zeros(64, 64, dtype=torch.bfloat16)
        weight[torch.arange(64), torch.arange(64)] = 0.5  # x @ W.T == x / 2 exactly
        assert torch.equal(module.bf16_linear(x, weight, None), x / 2)
    finally:
        module.set_cpu_isa(previous)


@needs_kernels
def test_set_cpu_isa_takes_only_the_known_instruction_sets():
    module = kernels.cpu_kernels()
    assert module.cpu_isa() in ("avx2", "avx512bf16")
    with pytest.raises(RuntimeError, match="avx2 or avx512bf16"):
        module.set_cpu_isa("sse2")
    if not _cpu_has_avx512_bf16():
        with pytest.raises(RuntimeError, match="no AVX-512 BF16"):
            module.set_cpu_isa("avx512bf16")


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
            return F.linear(x, weight.to(x.dtype), bias)

        @staticmethod
        def f32_linear(x, weight, bias):
            calls.append(-x.shape[0])
            return F.linear(x, weight, bias)

    monkeypatch.setattr(linears, "cpu_kernels", lambda: Spy)
    return calls


def test_every_cpu_linear_goes_to_the_kernels_at_any_number_of_rows(monkeypatch):
    """Prefill chunks too: a BLAS GEMM's summation order depends on the shape, so a row's result
    would depend on the rows beside it (batch invariance)."""
    calls = _spy(monkeypatch)
    weight = torch.randn(16, 32)
    for rows in (1, 4, 16, 17, 64, 300):
        linears.linear(torch.randn(rows, 32).bfloat16(), weight.bfloat16())
    for rows in (1, 3, 40):
        linears.linear(torch.randn(rows, 32), weight)  # float32 weights: f32_linear
    linears.float32_linear(torch.randn(20, 32), weight.bfloat16())  # an LM head
    linears.float32_linear(torch.randn(20, 32), weight)
    assert calls == [1, 4, 16, 17, 64, 300, -1, -3, -40, 20, -20]


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 5, 16, 17, 40])
@pytest.mark.parametrize(("out_features", "in_features"), [(1, 8), (7, 13), (130, 203)])
def test_f32_linear_matches_float64(rows, out_features, in_features):
    module = kernels.cpu_kernels()
    gen = torch.Generator(device="cpu").manual_seed(rows * 1000 + out_features)
    weight = torch.randn(out_features, in_features, generator=gen, device="cpu")
    bias = torch.randn(out_features, generator=gen, device="cpu")
    x = torch.randn(rows, in_features, generator=gen, device="cpu")
    ref = x.double() @ weight.double().t() + bias.double()  # [rows, out_features]
    out = module.f32_linear(x, weight, bias)
    assert out.dtype == torch.float32 and out.shape == (rows, out_features)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    assert module.f32_linear(x.bfloat16(), weight, None).dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="float32 weight"):
        module.f32_linear(x, weight.bfloat16(), None)


@pytest.mark.parametrize("with_bias", [False, True])
def test_float32_chunks_match_float64(monkeypatch, with_bias):
    monkeypatch.setattr(kernels, "_CHUNK_BYTES", 4 * 40 * 16)  # 16-row chunks: 3 and a tail
    x, weight = torch.randn(37, 40).bfloat16(), torch.randn(53, 40).bfloat16()
    bias = torch.randn(53).bfloat16() if with_bias else None
    ref = x.double() @ weight.double().t() + (0 if bias is None else bias.double())
    out = kernels.f32_chunked_linear(x, weight, bias)
    assert out.dtype == torch.bfloat16 and out.shape == (37, 53) and out.is_contiguous()
    torch.testing.assert_close(out.double(), ref, rtol=1e-2, atol=2e-2)


def test_without_the_kernel_torch_computes_the_same(monkeypatch):
    monkeypatch.setattr(linears, "cpu_kernels", lambda: None)
    weight, bias = torch.randn(16, 32).bfloat16(), torch.randn(16).bfloat16()
    for rows in (1, 3):
        x = torch.randn(rows, 32).bfloat16()
        ref = x.double() @ weight.double().t() + bias.double()
        out = linears.linear(x, weight, bias)
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


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [1, 7, 8, 13, 151936])
def test_argmax_rows_matches_torch(dtype, width):
    """The same index as torch.argmax in every case greedy sampling can meet: ties (the lowest
    index), a maximum in the tail past the last full 8 lanes, -inf rows, NaN (the first one)."""
    gen = torch.Generator().manual_seed(width)
    rows = torch.randn(8, width, generator=gen).to(dtype)
    rows[1] = rows[1].round()  # many ties at the maximum (bfloat16 rounds more of them)
    rows[2, -1] = 100.0  # in the tail
    rows[3] = float("-inf")
    rows[4, width // 2] = float("nan")
    rows[5] = 0.0
    rows[6, 0] = float("inf")
    rows[6, -1] = float("inf")
    module = kernels.cpu_kernels()
    assert torch.equal(module.argmax_rows(rows), rows.argmax(dim=-1))
    assert torch.equal(kernels.argmax_rows(rows[::2]), rows[::2].argmax(dim=-1))  # strided rows


def test_argmax_rows_falls_back_to_torch_off_its_shapes(monkeypatch):
    class OnlyTwoDimensionalFloatRows:
        def argmax_rows(self, x):
            assert x.dim() == 2 and x.dtype in (torch.float32, torch.bfloat16)
            return x.argmax(dim=-1)

    monkeypatch.setattr(kernels, "cpu_kernels", OnlyTwoDimensionalFloatRows)
    one_row = torch.tensor([0.5, 2.0, 2.0])
    assert kernels.argmax_rows(one_row).item() == 1  # 1-D: torch's
    halves = torch.tensor([[0.5, 2.0, 2.0]], dtype=torch.float16)
    assert kernels.argmax_rows(halves).tolist() == [1]
    assert kernels.argmax_rows(halves.float()).tolist() == [1]  # the kernel's shape


def test_every_kernel_releases_the_gil():
    """The engine thread runs the kernels while the server's event loop streams other requests:
    a kernel holding Python's GIL would stall every connection for the length of the call."""
    source = (Path(kernels.__file__).with_name("cpu_linear.cpp")).read_text()
    bindings = source[source.index("PYBIND11_MODULE") :].split("m.def(")[1:]
    names = [binding.split(",")[0].strip('"') for binding in bindings]
    assert len(names) >= 11 and "paged_attention" in names and "quant_linear_parts" in names
    assert "call_guard<pybind11::gil_scoped_release>" in source
    for name, binding in zip(names, bindings, strict=True):
        assert "kFree" in binding.split(");")[0], f"{name} is bound without releasing the GIL"


def test_each_checkout_builds_apart(tmp_path):
    """The build's commands hold its sources' absolute paths: two checkouts sharing a cache must
    not rebuild each other's build, so each gets its own directory (the same one every time)."""
    one, other = tmp_path / "one" / "kernels", tmp_path / "other" / "kernels"
    assert kernels.build_directory(tmp_path, one) == kernels.build_directory(tmp_path, one)
    assert kernels.build_directory(tmp_path, one) != kernels.build_directory(tmp_path, other)
    assert kernels.build_directory(tmp_path, one).name.startswith(kernels.build_key())
