"""engine/kernels/cpu_layer.cpp: RMSNorm, rotary embedding and silu(gate) * up against the torch
formulation the model runs elsewhere (engine/models/llama.py), and the model's choice between
them. bfloat16 results are equal bit for bit (both round where the other rounds); float32 ones
differ at most by float32 summation order. Paged attention has its own tests in test_attention.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import engine.kernels as kernels
from engine.models import llama

needs_kernels = pytest.mark.skipif(
    kernels.unavailable_reason() is not None, reason=str(kernels.unavailable_reason())
)
pytestmark = needs_kernels

DTYPES = [torch.float32, torch.bfloat16]


def _torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(llama, "layer_kernels", lambda x: None)


def _check(out: torch.Tensor, ref: torch.Tensor, *, float32_tol: float) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if out.dtype == torch.bfloat16:
        assert torch.equal(out, ref)
    else:
        torch.testing.assert_close(out, ref, atol=float32_tol, rtol=float32_tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (5, 1536), (3, 4, 20), (2, 13)])
def test_rms_norm_matches_torch(monkeypatch, dtype, shape):
    gen = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(*shape, generator=gen) * 4).to(dtype)
    norm = llama.RMSNorm(shape[-1], 1e-6, dtype)
    norm.weight = torch.nn.Parameter(torch.randn(shape[-1], generator=gen).to(dtype))
    out = norm(x)
    _torch_path(monkeypatch)
    _check(out, norm(x), float32_tol=2e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "head_dim"), [(12, 128), (3, 20)])
def test_rope_matches_torch_on_a_strided_split(monkeypatch, dtype, heads, head_dim):
    """q as the model takes it: a column slice of the fused qkv output (rows strided)."""
    gen = torch.Generator().manual_seed(heads)
    tokens = 5
    qkv = torch.randn(tokens, heads * head_dim + 2 * head_dim, generator=gen).to(dtype)
    q = qkv[:, : heads * head_dim].reshape(tokens, heads, head_dim)
    assert not q.is_contiguous()
    cos = torch.randn(tokens, head_dim, generator=gen).to(dtype)
    sin = torch.randn(tokens, head_dim, generator=gen).to(dtype)
    out = llama._apply_rope(q, cos, sin)
    assert out.is_contiguous()
    _torch_path(monkeypatch)
    ref = llama._apply_rope(q, cos, sin)
    # Each element is two products and a sum, each rounded as torch rounds it: equal in both.
    assert torch.equal(out, ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [8960, 13])
def test_silu_mul_matches_torch(dtype, width):
    gen = torch.Generator().manual_seed(width)
    x = (torch.randn(3, 2 * width, generator=gen) * 6).to(dtype)
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp's saturation and underflow
    gate, up = x.chunk(2, dim=-1)
    _check(kernels.cpu_kernels().silu_mul(x), F.silu(gate) * up, float32_tol=1e-6)


def test_layer_kernels_are_for_cpu_float32_and_bfloat16_only():
    assert llama.layer_kernels(torch.zeros(2, dtype=torch.bfloat16)) is kernels.cpu_kernels()
    assert llama.layer_kernels(torch.zeros(2, dtype=torch.float32)) is kernels.cpu_kernels()
    assert llama.layer_kernels(torch.zeros(2, dtype=torch.float16)) is None
    assert llama.layer_kernels(torch.zeros(2, device="meta")) is None


def test_logits_are_float32_sums_not_rounded_to_the_model_dtype(tiny_llama, tiny_qwen2):
    """A bfloat16 model's logits for decode rows are the LM head's float32 sums as they are:
    rounded to bfloat16 (8 bits), two logits tie far more often, and ties decide greedy output."""
    from engine.models.config import ModelConfig
    from engine.models.loader import load_model

    for path in (tiny_llama, tiny_qwen2):  # an untied head, and a head tied to the embedding
        cfg = ModelConfig.from_path(path)
        model = load_model(cfg, torch.bfloat16, torch.device("cpu"))
        head = model.embed_tokens if model.lm_head is None else model.lm_head
        hidden = torch.randn(3, cfg.hidden_size).bfloat16()
        logits = model.compute_logits(hidden)
        assert logits.dtype == torch.float32
        exact = hidden.double() @ head.weight.double().t()
        torch.testing.assert_close(logits.double(), exact, rtol=1e-5, atol=1e-5)
        assert not torch.equal(logits, logits.bfloat16().float())  # not bfloat16 values
