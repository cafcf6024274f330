"""The GPU's batch-invariant mode run on CPU by Triton's interpreter: the product and norm
kernels (engine/kernels/triton_invariant.py) agree with float64 references, a row's bits depend
neither on how many rows share the launch nor on what they hold, and a tiny model switched to
the mode (its products, norms and the Triton attention) gives every position's logits bit-equal
through every step shape.

Not collected by a plain `pytest tests/`: tests/unit/test_batch_invariant_mode.py runs this file
in a pytest subprocess with TRITON_INTERPRET=1 (see tests/unit/triton_interpreted.py for why).

What the interpreter does not model: a GPU's MMA instructions compute every row of a tile
alike, but the interpreter's `tl.dot` is one numpy product of the whole tile, whose BLAS
micro-kernels round rows at some places of a tile differently from others. So this file runs
`tl.dot` row by row (`_row_by_row_dot`), the same product for every row as on the GPU, and checks
what is the kernels' own doing: that a row's bits depend neither on how many rows share the
launch nor on what they hold, nor on the step's shape. tests/gpu/test_batch_invariant.py checks
the same on CUDA with the hardware's own products.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip(
        "run by tests/unit/test_batch_invariant_mode.py under TRITON_INTERPRET=1",
        allow_module_level=True,
    )

from triton.runtime import interpreter  # noqa: E402

from engine import LLM  # noqa: E402
from engine.attention.triton_attn import TritonAttentionBackend  # noqa: E402
from engine.kernels import triton_invariant  # noqa: E402
from engine.models.linears import enable_batch_invariant  # noqa: E402
from tests.integration.test_batch_invariance import check_step_shapes  # noqa: E402


def _row_by_row_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    """The interpreter's tl.dot (float16 and float32 operands), one row of `a` at a time."""
    rows = [np.matmul(row[None, :], b.data, dtype=d.data.dtype)[0] for row in a.data]
    return interpreter.TensorHandle(np.stack(rows) + d.data, d.dtype.scalar)


@pytest.fixture(autouse=True)
def products_row_by_row(monkeypatch):
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", _row_by_row_dot)


def test_the_kernels_run_in_the_interpreter():
    assert type(triton_invariant._matmul_kernel).__name__ == "InterpretedFunction"
    assert type(triton_invariant._rms_norm_kernel).__name__ == "InterpretedFunction"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 8, 16), (45, 100, 70), (70, 130, 200)])
def test_matmul_matches_float64(dtype, bias, m, n, k):
    # Shapes that leave partial tiles in every dimension (K past one or several K tiles).
    gen = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = torch.randn(n, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    expected = x.double() @ w.double().T + (b.double() if bias else 0)
    out = triton_invariant.matmul(x, w, b)
    assert out.shape == (m, n) and out.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), expected, atol=tol * k**0.5, rtol=tol)
    # float32 out: the unrounded sums (what the LM head's logits are).
    out32 = triton_invariant.matmul(x, w, b, out_dtype=torch.float32)
    assert out32.dtype == torch.float32
    torch.testing.assert_close(out32.double(), expected, atol=1e-4 * k**0.5, rtol=1e-4)
    if dtype == torch.float32:
        assert torch.equal(out32, out)


def test_matmul_takes_leading_dimensions_and_strided_rows():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 40, generator=gen)
    w = torch.randn(24, 40, generator=gen)
    out = triton_invariant.matmul(x, w)
    assert out.shape == (3, 5, 24)
    assert torch.equal(out.reshape(15, 24), triton_invariant.matmul(x.reshape(15, 40), w))
    wide = torch.randn(6, 80, generator=gen)
    strided = wide[:, ::2]  # a column stride of 2: copied to unit stride first
    torch.testing.assert_close(triton_invariant.matmul(strided, w), strided @ w.T)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_rows_bits_do_not_depend_on_the_other_rows_or_their_number(dtype):
    gen = torch.Generator().manual_seed(1)
    k, n = 150, 90  # several K tiles, a partial column tile
    w = torch.randn(n, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype)
    probe = torch.randn(k, generator=gen).to(dtype)
    alone = triton_invariant.matmul(probe[None], w, b)[0]
    for m in (2, 5, 16, 17, 32, 33, 100):
        for row in sorted({0, 1, m // 2, m - 1}):
            x = torch.randn(m, k, generator=gen).to(dtype)  # other rows: anything
            x[row] = probe
            assert torch.equal(triton_invariant.matmul(x, w, b)[row], alone), (m, row)
            got32 = triton_invariant.matmul(x, w, b, out_dtype=torch.float32)[row]
            assert torch.equal(got32.to(dtype), alone), (m, row)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rms_norm_matches_the_model_and_is_row_invariant(dtype):
    gen = torch.Generator().manual_seed(2)
    size = 96  # not a power of two: the block is padded
    weight = torch.randn(size, generator=gen).to(dtype)
    x = torch.randn(37, size, generator=gen).to(dtype) * 3
    out = triton_invariant.rms_norm(x, weight, 1e-6)
    xf = x.float()
    expected = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    assert out.dtype == expected.dtype and out.shape == x.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)
    for m in (1, 2, 5, 36):
        assert torch.equal(triton_invariant.rms_norm(x[-m:], weight, 1e-6), out[-m:]), m
    # [tokens, heads, head_dim] (q/k norms): per row of the last dimension.
    heads = x[:36].reshape(6, 6, size)
    assert torch.equal(triton_invariant.rms_norm(heads, weight, 1e-6).reshape(36, size), out[:36])


@pytest.fixture(scope="module")
def invariant_llm(tiny_llama):
    """The tiny Llama in float16 on CPU, switched to the GPU's batch-invariant mode by hand:
    its products and norms in the Triton kernels, attention in the Triton backend (the engine's
    configuration allows both on CUDA only)."""
    llm = LLM(
        str(tiny_llama),
        dtype="float16",
        quantization="none",
        attention_backend="torch",
        block_size=16,
        num_kv_blocks=24,
        max_model_len=128,
        enable_prefix_caching=False,
    )
    runner = llm.engine.runner
    runner.backend = TritonAttentionBackend()
    enable_batch_invariant(runner.model)
    return llm


def test_the_model_runs_every_product_and_norm_through_the_kernels(invariant_llm, monkeypatch):
    calls = {"matmul": 0, "rms_norm": 0}
    for name in calls:
        real = getattr(triton_invariant, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(triton_invariant, name, counted)
    runner = invariant_llm.engine.runner
    from tests.integration.test_batch_invariance import _Seq

    runner.forward([_Seq(0, 0, 16).chunk(0, 5)])
    layers = invariant_llm.engine.model_config.num_layers
    # Per layer: qkv, o, gate_up, down; then the LM head. Norms: two per layer and the final.
    assert calls == {"matmul": 4 * layers + 1, "rms_norm": 2 * layers + 1}


def test_every_positions_logits_are_the_same_in_every_step_shape(invariant_llm):
    check_step_shapes(invariant_llm, token_by_token=False)
