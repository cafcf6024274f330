"""The int8-activation GGUF products (engine/kernels/cpu_quant_int8.cpp, `gguf_activations:
int8`): the result is the dequantised weight times the activations as `quantize_activations`
rounds them (up to float32 summation order), a row's result is the same bits whatever the
batch and on either instruction set, and formats without an int8 product keep the float32 one."""

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
from engine.models.gguf import Q4_KT, QuantTensor, int8_layout, serving_layout
from tests.gguf_models import Q, random_blocks

pytestmark = pytest.mark.skipif(
    kernels.unavailable_reason() is not None, reason=str(kernels.unavailable_reason())
)

INT8_FORMATS = [Q.Q4_K, Q.Q6_K]  # served as Q4_KT and Q6_K8
ROOT = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def module():
    built = kernels.cpu_kernels()
    assert built is not None
    return built


def _served(qtype: Q, rows: int, columns: int, seed: int) -> tuple[QuantTensor, torch.Tensor]:
    raw = random_blocks(np.random.default_rng(seed), qtype, rows, columns)
    served = int8_layout(serving_layout(QuantTensor(torch.from_numpy(raw), int(qtype), columns)))
    weight = torch.from_numpy(dequantize(raw, qtype).reshape(rows, columns))
    return served, weight


@pytest.mark.parametrize("qtype", INT8_FORMATS, ids=lambda q: q.name)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 17, 40])
def test_the_product_is_the_quantised_activations_times_the_dequantised_weight(module, qtype, rows):
    served, weight = _served(qtype, 70, 768, rows)
    x = torch.randn(rows, 768, generator=torch.Generator().manual_seed(rows)) * 3
    out = module.quant_linear_int8(x, [served.blocks], [served.qtype], None)
    assert out.dtype == torch.float32 and out.shape == (rows, 70)
    quantised = kernels.quantize_activations(x).double()
    expected = quantised @ weight.double().t()
    # One activation rounded to the next step would move a product by ~1e-2 of this scale.
    tolerance = 1e-5 * (quantised.abs() @ weight.double().abs().t()).max().item()
    assert (out.double() - expected).abs().max().item() < tolerance
    # And close to the float32-activation product: the rounding is 1/254 of a block's largest
    # value at most, so the products move by well under a percent of their scale.
    exact = x.double() @ weight.double().t()
    scale = (x.double().abs() @ weight.double().abs().t()).max().item()
    assert (out.double() - exact).abs().max().item() < 1e-2 * scale


def test_activations_round_per_block_to_127_steps():
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(0))
    x[1, 256:] = 0.0  # an all-zero block stays zero (no division by its zero maximum)
    q = kernels.quantize_activations(x)
    for row in range(3):
        for block in range(2):
            values, got = x[row, 256 * block :][:256], q[row, 256 * block :][:256]
            amax = values.abs().max()
            if amax == 0:
                assert torch.equal(got, torch.zeros(256))
                continue
            steps = got / (amax / 127)
            assert torch.allclose(steps, steps.round(), atol=1e-3)
            assert steps.abs().max().round() == 127
            assert (got - values).abs().max() <= amax / 127 / 2 * 1.0001


@pytest.mark.parametrize("qtype", INT8_FORMATS, ids=lambda q: q.name)
def test_a_row_is_computed_alike_whatever_the_batch(module, qtype):
    # Integer sums are exact and a row's float operations are the same for any tile of rows
    # (up to 8 per pass over a weight row): a verify step's row equals the decode step's.
    served, _ = _served(qtype, 40, 2304, 3)
    x = torch.randn(25, 2304, generator=torch.Generator().manual_seed(3))
    alone = torch.cat(
        [
            module.quant_linear_int8(x[i : i + 1], [served.blocks], [served.qtype], None)
            for i in range(len(x))
        ]
    )
    for rows in (2, 3, 4, 5, 7, 8, 9, 12, 16, 25):
        together = module.quant_linear_int8(x[:rows], [served.blocks], [served.qtype], None)
        assert torch.equal(together, alone[:rows]), rows


def test_both_instruction_sets_give_the_same_bits(module, tmp_path):
    """AVX-512 VNNI's vpdpbusd and vpdpwssd and AVX2's vpmaddubsw, vpmaddwd and adds make the
    same integers: a server started with SPECSERVE_CPU_ISA=avx2 samples the same tokens."""
    served, _ = _served(Q.Q4_K, 24, 512, 5)
    x = torch.randn(6, 512, generator=torch.Generator().manual_seed(5))
    torch.save({"x": x, "blocks": served.blocks, "qtype": served.qtype}, tmp_path / "case.pt")
    script = (
        "import sys, torch; from engine import kernels; m = kernels.cpu_kernels(); "
        "c = torch.load(sys.argv[1]); "
        "torch.save(m.quant_linear_int8(c['x'], [c['blocks']], [c['qtype']], None), sys.argv[2]); "
        "print(m.int8_isa())"
    )
    told = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "case.pt"), str(tmp_path / "out.pt")],
        env={**os.environ, "SPECSERVE_CPU_ISA": "avx2"},
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    assert told.stdout.split()[-1] == "avx2"
    ours = module.quant_linear_int8(x, [served.blocks], [served.qtype], None)
    assert torch.equal(torch.load(tmp_path / "out.pt"), ours)


def test_q4_kt_holds_the_q4_k_weights_in_the_int8_products_order(module):
    """int8_layout reorders each Q4_K block's weights (same bytes, same values: the header and
    scales unchanged); the transpose is its own inverse; Q4_KT has only the int8 product, and
    Q4_K in its file's order only the float32 one."""
    raw = random_blocks(np.random.default_rng(11), Q.Q4_K, 6, 768)
    q4_k = QuantTensor(torch.from_numpy(raw), int(Q.Q4_K), 768)
    q4_kt = int8_layout(q4_k)
    assert (q4_kt.qtype, q4_kt.format, q4_kt.blocks.shape) == (Q4_KT, "Q4_K", q4_k.blocks.shape)
    assert torch.equal(q4_kt.dequantize(), q4_k.dequantize())
    assert torch.equal(
        q4_kt.dequantize(), torch.from_numpy(dequantize(raw, Q.Q4_K)).reshape(6, 768)
    )
    blocks = q4_kt.blocks.view(6, 3, 144)
    assert torch.equal(blocks[..., :16], q4_k.blocks.view(6, 3, 144)[..., :16])
    assert not torch.equal(q4_kt.blocks, q4_k.blocks)
    assert torch.equal(module.repack_q4_k_t(q4_kt.blocks, 768), q4_k.blocks)
    # Weight 32 s + 4 r + b of a block sits at position 32 r + 4 s + b: one block whose weights
    # count 0, 1, 2, ... (mod 16) in the file's order, read back in the new one.
    values = np.arange(256) % 16
    one = raw[:1, :144].copy()
    for c in range(4):
        one[0, 16 + 32 * c : 48 + 32 * c] = values[64 * c : 64 * c + 32] | (
            values[64 * c + 32 : 64 * c + 64] << 4
        )
    moved = module.repack_q4_k_t(torch.from_numpy(one), 256)[0, 16:].numpy()
    order = np.concatenate(
        [
            np.stack([moved[32 * c : 32 * c + 32] & 15, moved[32 * c : 32 * c + 32] >> 4]).reshape(
                -1
            )
            for c in range(4)
        ]
    )
    expected = [(32 * s + 4 * r + b) % 16 for r in range(8) for s in range(8) for b in range(4)]
    assert order.tolist() == expected
    assert kernels.int8_supported(Q4_KT, 768) and not kernels.int8_supported(int(Q.Q4_K), 768)
    with pytest.raises(RuntimeError, match="no float32-activation product"):
        kernels.quant_linear(torch.randn(1, 768), [q4_kt.blocks], [Q4_KT])


def test_the_largest_q4_kt_sums_are_exact_on_both_instruction_sets(module, tmp_path):
    """Every weight 15, every scale and offset 63, every activation +-127 steps: the largest
    integer sums a block can make (AVX2 adds eight pairs of products in 16 bits: 30,480 at most)
    come out as the double-precision product on both instruction sets."""
    raw = random_blocks(np.random.default_rng(12), Q.Q4_K, 16, 512)
    blocks = raw.reshape(16, 2, 144)
    blocks[..., 4:16] = 255  # six-bit scales and offsets all 63
    blocks[..., 16:] = 255  # every nibble 15
    served = int8_layout(QuantTensor(torch.from_numpy(raw), int(Q.Q4_K), 512))
    x = torch.full((3, 512), 2.0)
    x[1] = -2.0
    x[2, ::2] = -2.0
    weight = torch.from_numpy(dequantize(raw, Q.Q4_K).reshape(16, 512)).double()
    expected = x.double() @ weight.t()  # +-2 is 127 steps of 2 / 127: quantised exactly
    ours = module.quant_linear_int8(x, [served.blocks], [Q4_KT], None)
    assert torch.allclose(ours.double(), expected, rtol=1e-5, atol=1e-3)
    torch.save({"x": x, "blocks": served.blocks}, tmp_path / "case.pt")
    script = (
        "import sys, torch; from engine import kernels; m = kernels.cpu_kernels(); "
        "c = torch.load(sys.argv[1]); "
        f"torch.save(m.quant_linear_int8(c['x'], [c['blocks']], [{Q4_KT}], None), sys.argv[2])"
    )
    subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "case.pt"), str(tmp_path / "out.pt")],
        env={**os.environ, "SPECSERVE_CPU_ISA": "avx2"},
        check=True,
        cwd=ROOT,
    )
    assert torch.equal(torch.load(tmp_path / "out.pt"), ours)


def test_the_isa_is_vnni_where_the_cpu_has_it():
    flags: set[str] = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    has_vnni = {"avx512_vnni", "avx512vl"} <= flags
    expected = (
        "avx512vnni" if has_vnni and os.environ.get("SPECSERVE_CPU_ISA") != "avx2" else "avx2"
    )
    assert kernels.cpu_kernels().int8_isa() == expected


@pytest.mark.parametrize("rows", [1, 5, 19])
def test_a_fused_projection_mixes_int8_and_float32_runs(module, rows):
    """A qkv whose q/k runs are Q4_K, v Q6_K and one run Q8_0 (no int8 product here): the K-quant
    runs take int8 activations in one call, the Q8_0 run the float32 product, plus the bias."""
    rng = np.random.default_rng(rows)
    runs = [
        int8_layout(
            serving_layout(
                QuantTensor(torch.from_numpy(random_blocks(rng, q, n, 512)), int(q), 512)
            )
        )
        for q, n in ((Q.Q4_K, 48), (Q.Q6_K, 16), (Q.Q8_0, 8))
    ]
    blocks, qtypes = [run.blocks for run in runs], [run.qtype for run in runs]
    assert [kernels.int8_supported(q, 512) for q in qtypes] == [True, True, False]
    assert not kernels.int8_supported(int(Q.Q4_K), 640)  # not whole blocks of 256
    bias = torch.randn(72)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    out = kernels.quant_linear(x, blocks, qtypes, bias, int8=True)
    assert out.shape == (rows, 72)
    int8_part = module.quant_linear_int8(x, blocks[:2], qtypes[:2], None)
    float_part = kernels.quant_linear(x, blocks[2:], qtypes[2:])
    assert torch.equal(out, torch.cat([int8_part, float_part], dim=1) + bias)
    # All runs int8: one call, the same as the parts alone side by side.
    both = kernels.quant_linear(x, blocks[:2], qtypes[:2], bias[:64], int8=True)
    alone = [
        module.quant_linear_int8(x, [b], [q], None)
        for b, q in zip(blocks[:2], qtypes[:2], strict=True)
    ]
    assert torch.equal(both, torch.cat(alone, dim=1) + bias[:64])


def test_the_int8_product_refuses_what_it_cannot_compute(module):
    q8_0 = serving_layout(
        QuantTensor(
            torch.from_numpy(random_blocks(np.random.default_rng(0), Q.Q8_0, 4, 256)),
            int(Q.Q8_0),
            256,
        )
    )
    with pytest.raises(RuntimeError, match="no int8 product"):
        module.quant_linear_int8(torch.randn(1, 256), [q8_0.blocks], [q8_0.qtype], None)
    q4_k, _ = _served(Q.Q4_K, 4, 512, 0)
    with pytest.raises(RuntimeError, match="bytes"):
        module.quant_linear_int8(torch.randn(1, 256), [q4_k.blocks], [q4_k.qtype], None)
    with pytest.raises(RuntimeError, match="a bias of 4"):
        module.quant_linear_int8(torch.randn(1, 512), [q4_k.blocks], [q4_k.qtype], torch.ones(3))
    assert module.quant_linear_int8(
        torch.randn(0, 512), [q4_k.blocks], [q4_k.qtype], None
    ).shape == (0, 4)


@pytest.mark.parametrize("int8", [False, True], ids=["float32-activations", "int8-activations"])
def test_some_output_rows_alone_are_those_of_the_whole_product(int8):
    """output_rows (the K/V part of a fused projection, say) multiplies by those weight rows
    only, across runs of different formats, and gives bit for bit the whole product's columns;
    a dense Linear's likewise."""
    from engine.models.linears import Linear, QuantLinear, output_rows

    rng = np.random.default_rng(7)
    layer = QuantLinear(512, 72, bias=True, dtype=torch.float32)
    layer.bias = torch.nn.Parameter(torch.randn(72))
    layer.set_weight(
        [
            (int8_layout if int8 else serving_layout)(
                serving_layout(
                    QuantTensor(torch.from_numpy(random_blocks(rng, q, n, 512)), int(q), 512)
                )
            )
            for q, n in ((Q.Q4_K, 48), (Q.Q6_K, 16), (Q.Q8_0, 8))
        ]
    )
    layer.int8_activations = int8
    dense = Linear(512, 72, bias=True)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(5))
    for module in (layer, dense):
        whole = module(x)
        for start, end in ((48, 72), (40, 60), (0, 16), (66, 70)):
            assert torch.equal(output_rows(module, x, start, end), whole[:, start:end])
