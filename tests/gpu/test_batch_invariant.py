"""The batch-invariant mode on the device (`batch_invariant: true`): the Triton products, norms
and SwiGLU give every row the bits it has alone, at every row count a step can have; a model in
the mode gives every position's logits bit-equal through every step shape; greedy answers (and
their logprobs) of requests served together, in mixed steps, with n-gram speculation, equal each
request asked alone. On a CPU dry run the mode is the CPU kernels' (the kernel checks skip).
Whether the default mode (flash-attn or Triton attention with cuBLAS) is batch-invariant on this
node is recorded, not asserted: it is not promised."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.attention import triton_available
from tests.gpu.node import needs_device
from tests.integration.test_batch_invariance import _answer, _prompts, check_step_shapes

pytestmark = [pytest.mark.gpu, needs_device, pytest.mark.gpu_check("batch-invariant mode")]

needs_cuda_triton = pytest.mark.skipif(not triton_available(), reason="needs CUDA and Triton")
ROW_COUNTS = (*range(1, 41), 64, 100, 256, 300, 1024, 2048)
PROBES = (0, 1, 2, 7, 15, 16, 17, 31, 32, 33, 39)  # rows whose bits are followed


def _rows_keep_their_bits(op, make_rows) -> None:
    """op(rows)[i] for each probe i equals op(rows[i:i+1]) for every row count holding i."""
    rows = make_rows(max(ROW_COUNTS))
    alone = {i: op(rows[i : i + 1])[0] for i in PROBES}
    for m in ROW_COUNTS:
        out = op(rows[:m])
        for i in PROBES:
            if i < m:
                assert torch.equal(out[i], alone[i]), (m, i)


@needs_cuda_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_the_kernels_give_every_row_its_bits_alone(dtype):
    from engine.kernels import triton_invariant as ti

    cuda = torch.device("cuda")
    gen = torch.Generator(device=cuda).manual_seed(0)
    hidden, inter = 1536, 2 * 4480  # a 1.5B model's widths: many K tiles, a partial N tile

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=cuda).to(dtype)

    weight, bias, gate_up_w = randn(hidden, hidden), randn(hidden), randn(inter, hidden)
    _rows_keep_their_bits(lambda x: ti.matmul(x, weight, bias), lambda m: randn(m, hidden))
    _rows_keep_their_bits(
        lambda x: ti.matmul(x, gate_up_w, out_dtype=torch.float32), lambda m: randn(m, hidden)
    )
    norm_w = randn(hidden)
    _rows_keep_their_bits(lambda x: ti.rms_norm(x, norm_w, 1e-6), lambda m: randn(m, hidden))
    _rows_keep_their_bits(ti.silu_mul, lambda m: randn(m, inter))
    # And they compute what they should.
    x = randn(37, hidden)
    expected = x.double() @ weight.double().T + bias.double()
    tol = {torch.float32: 1e-3, torch.float16: 0.1, torch.bfloat16: 0.5}[dtype]
    torch.testing.assert_close(ti.matmul(x, weight, bias).double(), expected, atol=tol, rtol=0.02)


def _llm(gpu_target, device, dtype: str, batch_invariant: bool, **kwargs) -> LLM:
    settings = dict(
        device=str(device),
        dtype=dtype,
        batch_invariant=batch_invariant,
        block_size=16,
        max_model_len=256,
        enable_prefix_caching=False,
    )
    settings.update(kwargs)
    return LLM(str(gpu_target), num_kv_blocks=64, **settings)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_every_positions_logits_are_the_same_in_every_step_shape(gpu_target, device, dtype):
    llm = _llm(gpu_target, device, dtype, True)
    expected = "triton" if device.type == "cuda" else "cpu"
    assert llm.engine.config.attention_backend == expected
    check_step_shapes(llm)


def test_greedy_answers_together_equal_each_asked_alone(gpu_target, device):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    alone = _llm(gpu_target, device, "bfloat16", True, max_num_seqs=1)
    expected = [_answer(o) for o in alone.generate(_prompts(), params)]
    del alone
    speculation = {
        "method": "ngram",
        "mode": "always",
        "num_speculative_tokens": 3,
        "prompt_lookup_min": 1,
    }
    for extra in ({}, {"speculative_config": speculation}):
        together = _llm(gpu_target, device, "bfloat16", True, max_num_batched_tokens=6, **extra)
        got = [_answer(o) for o in together.generate(_prompts(), params)]
        assert got == expected, extra


def test_the_default_mode_is_recorded(gpu_target, device, gpu_record):
    llm = _llm(gpu_target, device, "bfloat16", False, block_size=None)
    try:
        check_step_shapes(llm)
        verdict = "bit-equal here too (not promised)"
    except AssertionError as error:
        verdict = f"differs ({str(error).splitlines()[0]})"
    gpu_record(f"default mode ({llm.engine.config.attention_backend}), step shapes", verdict)
