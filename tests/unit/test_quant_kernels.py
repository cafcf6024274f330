"""The GGUF block kernels (engine/kernels/cpu_quant.cpp): for every format a file may hold, in the
layout the engine serves it in (`serving_layout`), `dequantize` gives the gguf package's values
bit for bit, and our linear (and the dequantised-chunks baseline) multiply by exactly those
weights (float32 results within summation-order rounding of a float64 product)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf.quants import dequantize

from engine import kernels
from engine.models.gguf import QUANT_FORMATS, QuantTensor, serving_layout
from tests.gguf_models import Q, random_blocks

pytestmark = pytest.mark.skipif(
    kernels.unavailable_reason() is not None, reason=str(kernels.unavailable_reason())
)

FORMATS = [Q(qtype) for qtype in QUANT_FORMATS]


@pytest.fixture(scope="module")
def module():
    built = kernels.cpu_kernels()
    assert built is not None
    return built


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_dequantize_equals_the_gguf_package_bit_for_bit(module, qtype):
    blocks = random_blocks(np.random.default_rng(int(qtype)), qtype, 37, 512)
    served = serving_layout(QuantTensor(torch.from_numpy(blocks), int(qtype), 512))
    ours = module.dequantize(served.blocks, served.qtype, 512)
    reference = torch.from_numpy(dequantize(blocks, qtype).reshape(37, 512))
    assert ours.dtype == torch.float32
    assert torch.equal(ours, reference)


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 9, 17])
def test_linear_multiplies_by_the_dequantised_weight(module, qtype, rows):
    rng = np.random.default_rng(rows)
    raw = random_blocks(rng, qtype, 70, 768)
    served = serving_layout(QuantTensor(torch.from_numpy(raw), int(qtype), 768))
    blocks, layout = served.blocks, served.qtype
    weight = torch.from_numpy(dequantize(raw, qtype).reshape(70, 768)).double()
    x = torch.randn(rows, 768, generator=torch.Generator().manual_seed(rows))
    expected = x.double() @ weight.t()
    tolerance = 1e-5 * (x.double().abs() @ weight.abs().t()).max().item()
    # Our kernel (the model's route at any M) and the dequantised-chunks GEMM (a benchmark
    # baseline).
    for fn in (kernels.quant_linear, kernels.dequantized_chunks_linear):
        out = fn(x, [blocks], [layout]) if fn is kernels.quant_linear else fn(x, blocks, layout)
        assert out.shape == (rows, 70) and out.dtype == torch.float32, fn
        assert (out.double() - expected).abs().max().item() < tolerance, fn
    # bfloat16 activations are read as float32.
    out = module.quant_linear(x.bfloat16(), blocks, layout)
    assert torch.allclose(out.double(), x.bfloat16().double() @ weight.t(), atol=tolerance)


@pytest.mark.parametrize("columns", [512, 9216])
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_a_row_is_computed_alike_whatever_the_batch(module, qtype, columns):
    # Each output is summed in one order however many activation rows share the pass, so a
    # verify step's row equals the decode step's for the same input. On AVX-512 CPUs Q4_K takes
    # its 16-lane form at every size, in passes of up to 6 rows (so 7+ rows are several passes),
    # and the other formats' batches of 4 rows or more the two-rows-per-register form (pairs,
    # then an odd row by AVX2), single rows never: equality with the single rows holds it to the
    # AVX2 arithmetic. A batch whose activations outgrow L1 (9216 columns: from 2 rows) walks
    # the columns in chunks across the weight rows, its sums waiting between chunks: a single
    # row, or 512 columns, is one pass.
    raw = random_blocks(np.random.default_rng(3), qtype, 40, columns)
    served = serving_layout(QuantTensor(torch.from_numpy(raw), int(qtype), columns))
    x = torch.randn(19, columns, generator=torch.Generator().manual_seed(3))
    alone = torch.cat(
        [module.quant_linear(x[i : i + 1], served.blocks, served.qtype) for i in range(len(x))]
    )
    for rows in (2, 3, 4, 5, 7, 8, 9, 12, 16, 19):
        together = module.quant_linear(x[:rows], served.blocks, served.qtype)
        assert torch.equal(together, alone[:rows]), rows


def _cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def test_batches_take_avx512_where_the_cpu_has_it_unless_told_avx2(module):
    expected = "avx512" if {"avx512f", "avx512dq"} <= _cpu_flags() else "avx2"
    if os.environ.get("SPECSERVE_CPU_ISA") == "avx2":
        expected = "avx2"
    assert module.quant_isa() == expected
    told = subprocess.run(
        [
            sys.executable,
            "-c",
            "from engine import kernels; print(kernels.cpu_kernels().quant_isa())",
        ],
        env={**os.environ, "SPECSERVE_CPU_ISA": "avx2"},
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).parents[2],
    )
    assert told.stdout.split()[-1] == "avx2"


def test_the_kernels_refuse_what_they_cannot_compute(module):
    blocks = torch.from_numpy(random_blocks(np.random.default_rng(0), Q.Q4_K, 4, 256))
    with pytest.raises(RuntimeError, match="unsupported GGML type"):
        module.dequantize(blocks, 13, 256)  # Q5_K
    q6_k = torch.from_numpy(random_blocks(np.random.default_rng(0), Q.Q6_K, 4, 256))
    with pytest.raises(RuntimeError, match="unsupported GGML type"):
        module.dequantize(q6_k, int(Q.Q6_K), 256)  # read only at load, by repack_q6_k
    with pytest.raises(RuntimeError, match="bytes"):
        module.dequantize(blocks, int(Q.Q4_K), 512)
    with pytest.raises(RuntimeError, match="multiple of 256"):
        module.quant_linear(torch.randn(1, 96), blocks[:, :54], int(Q.Q4_K))
    with pytest.raises(RuntimeError, match="uint8"):
        module.dequantize(blocks.float(), int(Q.Q4_K), 256)


@pytest.mark.parametrize(("source", "layout"), [(Q.Q6_K, 1014), (Q.Q5_0, int(Q.Q8_0))])
def test_repacked_layouts_hold_the_same_weights(module, source, layout):
    from engine.models.gguf import QuantTensor, serving_layout

    blocks = random_blocks(np.random.default_rng(9), source, 33, 512)
    served = serving_layout(QuantTensor(torch.from_numpy(blocks), int(source), 512))
    assert served.qtype == layout and served.format == source.name
    reference = torch.from_numpy(dequantize(blocks, source).reshape(33, 512))
    assert torch.equal(served.dequantize(), reference)
    x = torch.randn(3, 512)
    expected = x.double() @ reference.double().t()
    tolerance = 1e-5 * (x.double().abs() @ reference.double().abs().t()).max().item()
    for out in (
        kernels.quant_linear(x, [served.blocks], [served.qtype]),
        kernels.dequantized_chunks_linear(x, served.blocks, served.qtype),
    ):
        assert (out.double() - expected).abs().max().item() < tolerance


@pytest.mark.parametrize("rows", [1, 5, 19])
def test_a_fused_projection_of_mixed_formats_is_one_product(module, rows):
    """Runs of rows in different formats (a Q4_K_M qkv with a Q6_K v) plus a bias, in one call at
    any number of rows: the same values as each run's own product side by side, plus the
    bias."""
    rng = np.random.default_rng(rows)
    runs = [
        serving_layout(QuantTensor(torch.from_numpy(random_blocks(rng, q, n, 512)), int(q), 512))
        for q, n in ((Q.Q4_K, 48), (Q.Q6_K, 16), (Q.Q8_0, 8))
    ]
    blocks, qtypes = [run.blocks for run in runs], [run.qtype for run in runs]
    bias = torch.randn(72).bfloat16()
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)).bfloat16()
    out = kernels.quant_linear(x, blocks, qtypes, bias)
    assert out.dtype == torch.float32 and out.shape == (rows, 72)
    alone = torch.cat(
        [module.quant_linear(x, b, q) for b, q in zip(blocks, qtypes, strict=True)], dim=1
    )
    assert torch.equal(out, alone + bias.float())
    with pytest.raises(RuntimeError, match="one GGML type per part"):
        module.quant_linear_parts(x, blocks, qtypes[:2], None)
