"""The CUDA path's fused layer kernels (engine/kernels/triton_layer.py) on CPU, in Triton's
interpreter: each equals the torch formulation it replaces, a whole forward on the fused path
equals the unfused one, and a decode step launches LAYER_KERNELS kernels per decoder layer.

Not collected by a plain `pytest tests/` (no test_ prefix): tests/unit/test_triton_layer.py runs
this file in a pytest subprocess with TRITON_INTERPRET=1 (see tests/unit/triton_interpreted.py
for why, and why float32 and float16 only).

The count: a TorchDispatchMode sees every aten op the forward calls (what runs on a CUDA device
as one kernel each: views, and allocations without a fill, launch none and are not counted), and
the interpreter's launch entry point is wrapped to count each Triton launch (the aten ops the
interpreter itself calls to move tensors in and out are not the model's, and are not counted).
The ops the forward calls on the CPU here are those it calls on CUDA: the fused path chooses its
kernels by `ForwardContext.fused`, never by the tensors' device. Per layer is the difference of a
2-layer and a 1-layer model, so the embedding, the final norm and the LM head drop out.
"""

from __future__ import annotations

import os
import random
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip(
        "run by tests/unit/test_triton_layer.py under TRITON_INTERPRET=1", allow_module_level=True
    )

import triton.runtime.interpreter as interpreter  # noqa: E402

from engine.attention import triton_attn  # noqa: E402
from engine.attention.base import flatten_step, write_kv  # noqa: E402
from engine.core.chunks import SeqChunk  # noqa: E402
from engine.kernels import triton_layer  # noqa: E402
from engine.models import linears, llama  # noqa: E402
from engine.models.config import ModelConfig  # noqa: E402
from engine.models.llama import ForwardContext, LlamaForCausalLM  # noqa: E402
from engine.models.loader import load_model  # noqa: E402
from engine.models.rope import RotaryEmbedding  # noqa: E402
from tests.conftest import build_tiny_model  # noqa: E402

CPU = torch.device("cpu")
BLOCK_SIZE = 16
NUM_BLOCKS = 64


def test_the_kernels_run_in_the_interpreter():
    assert type(triton_layer._add_rms_norm_kernel).__name__ == "InterpretedFunction"


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    xf = x.to(torch.float32)
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hidden", [64, 96])  # 96: a row padded to a power of two
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_matches_torch(dtype, hidden, with_residual):
    g = torch.Generator().manual_seed(hidden)
    x = torch.randn(5, hidden, generator=g).to(dtype)
    residual = torch.randn(5, hidden, generator=g).to(dtype) if with_residual else None
    weight = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype)
    out, stream = triton_layer.add_rms_norm(x, residual, weight, 1e-6)
    expected_stream = x + residual if residual is not None else x
    assert torch.equal(stream, expected_stream)  # the sum is rounded once, as torch's add
    tol = 1e-6 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(
        out, torch_rms_norm(expected_stream, weight, 1e-6), atol=tol, rtol=tol
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("inter", [128, 1500])  # 1500: two column blocks, the last one partial
def test_silu_mul_matches_torch(dtype, inter):
    gate_up = torch.randn(3, 2 * inter, generator=torch.Generator().manual_seed(inter)).to(dtype)
    gate, up = gate_up.float().chunk(2, dim=-1)
    tol = 1e-6 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(
        triton_layer.silu_mul(gate_up).float(),
        torch.nn.functional.silu(gate) * up,
        atol=tol,
        rtol=tol,
    )


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(4, 2, 16), (6, 1, 32)])
def test_rope_write_kv_matches_rope_then_the_cache_write(num_heads, num_kv_heads, head_dim):
    g = torch.Generator().manual_seed(num_heads)
    num_tokens, q_size, kv_size = 7, num_heads * head_dim, num_kv_heads * head_dim
    # q, k and v as the layer has them: views into one q/k/v projection.
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=g)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.reshape(num_tokens, num_heads, head_dim)
    k = k.reshape(num_tokens, num_kv_heads, head_dim)
    v = v.reshape(num_tokens, num_kv_heads, head_dim)
    positions = torch.tensor([0, 5, 17, 300, 1, 2, 99])
    rope = RotaryEmbedding(_Config(), head_dim, 512, CPU)
    cos, sin = rope(positions, torch.float32)
    shape = (NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim)
    slots = torch.tensor(random.Random(0).sample(range(NUM_BLOCKS * BLOCK_SIZE), num_tokens))
    k_ref, v_ref = torch.zeros(shape), torch.zeros(shape)
    q_ref = llama._apply_rope(q.clone(), cos, sin)
    write_kv(k_ref, v_ref, llama._apply_rope(k.clone(), cos, sin), v.clone(), slots)
    k_cache, v_cache = torch.zeros(shape), torch.zeros(shape)
    triton_layer.rope_write_kv(q, k, v, cos, sin, k_cache, v_cache, slots)
    torch.testing.assert_close(q, q_ref, atol=1e-6, rtol=1e-6)  # rotated in place
    torch.testing.assert_close(k_cache, k_ref, atol=1e-6, rtol=1e-6)
    assert torch.equal(v_cache, v_ref)


class _Config:
    rope_theta = 10000.0
    rope_scaling = None


def _model(tmp: Path, num_layers: int) -> tuple[LlamaForCausalLM, RotaryEmbedding, ModelConfig]:
    path = build_tiny_model(tmp / f"layers{num_layers}", "qwen2", num_hidden_layers=num_layers)
    cfg = ModelConfig.from_path(path)
    model = load_model(cfg, torch.float32, CPU)
    return model, RotaryEmbedding(cfg.hf_config, cfg.head_dim, 512, CPU), cfg


def _forward(model, rope, cfg, chunks, fused: bool, caches=None):
    """Logits rows of every chunk's last token, and the caches the step wrote."""
    backend = triton_attn.TritonAttentionBackend()
    step = flatten_step(chunks, BLOCK_SIZE)
    shape = (NUM_BLOCKS, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
    if caches is None:
        caches = tuple((torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_layers))
    cos, sin = rope(torch.tensor(step.positions), torch.float32)
    ctx = ForwardContext(
        backend, backend.build_metadata(step.layout, CPU), caches, cos, sin, fused=fused
    )
    hidden = model(torch.tensor(step.token_ids), ctx)
    return model.compute_logits(hidden[torch.tensor(step.logit_rows)]), caches


def _prompts(seed: int) -> list[SeqChunk]:
    rng = random.Random(seed)
    return [
        SeqChunk([rng.randrange(3, 320) for _ in range(n)], 0, blocks, 1)
        for n, blocks in ((18, [3, 9]), (5, [4]), (20, [0, 7]))
    ]


@torch.inference_mode()
def test_a_fused_forward_equals_the_unfused_one(tmp_path):
    model, rope, cfg = _model(tmp_path, 2)
    prompts = _prompts(1)
    fused, fused_caches = _forward(model, rope, cfg, prompts, fused=True)
    plain, plain_caches = _forward(model, rope, cfg, prompts, fused=False)
    torch.testing.assert_close(fused, plain, atol=1e-4, rtol=1e-4)
    assert torch.equal(fused.argmax(-1), plain.argmax(-1))
    for (k, v), (k_ref, v_ref) in zip(fused_caches, plain_caches, strict=True):
        torch.testing.assert_close(k, k_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v, v_ref, atol=1e-5, rtol=1e-5)
    # A decode step over those caches: the cached K/V the fused path wrote are read back.
    decode = [
        SeqChunk([int(t)], len(c.token_ids), c.block_table, 1)
        for c, t in zip(prompts, fused.argmax(-1), strict=True)
    ]
    step_fused, _ = _forward(model, rope, cfg, decode, fused=True, caches=fused_caches)
    step_plain, _ = _forward(model, rope, cfg, decode, fused=False, caches=plain_caches)
    torch.testing.assert_close(step_fused, step_plain, atol=1e-4, rtol=1e-4)


# Ops that launch no kernel on CUDA: views and allocations without a fill.
_NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "lift_fresh", "detach"}


class KernelCounter(TorchDispatchMode):
    """Counts the aten ops that launch a kernel, and (as `active`, through `as_on_cuda`) the
    Triton launches."""

    active: KernelCounter | None = None

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.in_triton = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.in_triton and not func.is_view and name not in _NO_KERNEL:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def as_on_cuda(monkeypatch):
    """Triton launches counted into the active KernelCounter, and the ops CUDA runs: our CPU
    kernels (the layer's and the linears') serve CPU tensors only, so they are turned off."""
    run = interpreter.InterpretedFunction.run

    def counted(self, *args, **kwargs):
        counter = KernelCounter.active
        if counter is None:
            return run(self, *args, **kwargs)
        counter.ops[f"triton:{self.fn.__name__}"] += 1
        counter.in_triton += 1
        try:
            return run(self, *args, **kwargs)
        finally:
            counter.in_triton -= 1

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", counted)
    monkeypatch.setattr(llama, "layer_kernels", lambda x: None)
    monkeypatch.setattr(linears, "cpu_kernels", lambda: None)


def _count_decode_step(
    tmp_path, num_layers: int, fused: bool, context: int | None = None
) -> Counter[str]:
    """The launches of a decode step of the prompts of `_prompts(2)` (or of two requests of
    `context` tokens each, over zeroed blocks)."""
    model, rope, cfg = _model(tmp_path, num_layers)
    # What the caches hold does not change what a step launches: zeros, no prefill to run.
    shape = (NUM_BLOCKS, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
    caches = tuple((torch.zeros(shape), torch.zeros(shape)) for _ in range(num_layers))
    decode = [SeqChunk([7], len(c.token_ids), c.block_table, 1) for c in _prompts(2)]
    if context is not None:
        blocks = -(-(context + 1) // BLOCK_SIZE)
        assert 2 * blocks <= NUM_BLOCKS
        decode = [SeqChunk([7], context, list(range(i, 2 * blocks, 2)), 1) for i in (0, 1)]
    counter = KernelCounter()
    backend = triton_attn.TritonAttentionBackend()
    step = flatten_step(decode, BLOCK_SIZE)
    meta = backend.build_metadata(step.layout, CPU)
    cos, sin = rope(torch.tensor(step.positions), torch.float32)
    ctx = ForwardContext(backend, meta, caches, cos, sin, fused=fused)
    ids = torch.tensor(step.token_ids)
    with torch.inference_mode(), counter:
        KernelCounter.active = counter
        try:
            model(ids, ctx)
        finally:
            KernelCounter.active = None
    return counter.ops


def _per_layer(tmp_path, fused: bool, context: int | None = None) -> Counter[str]:
    one = _count_decode_step(tmp_path, 1, fused, context)
    two = _count_decode_step(tmp_path, 2, fused, context)
    assert not (one - two), (one, two)
    return two - one


def test_a_decode_step_launches_the_stated_kernels_per_layer(as_on_cuda, tmp_path):
    fused = _per_layer(tmp_path / "fused", fused=True)
    assert fused == Counter(
        {
            "triton:_add_rms_norm_kernel": 2,
            "linear": 4,  # q/k/v (its bias in the GEMM), o, gate/up, down: a GEMM each
            "triton:_rope_write_kv_kernel": 1,
            "triton:paged_attention_kernel": 1,
            "triton:_silu_mul_kernel": 1,
        }
    ), fused
    assert sum(fused.values()) == triton_layer.LAYER_KERNELS
    # The torch formulation the fused path replaces launches several times as many.
    plain = _per_layer(tmp_path / "plain", fused=False)
    assert sum(plain.values()) >= 3 * triton_layer.LAYER_KERNELS, plain


def test_a_long_context_decode_splits_its_attention_in_two_launches(as_on_cuda, tmp_path):
    # Past one partition, a step this small takes the split path: partials, then their merge
    # (engine/attention/triton_attn.py "Split contexts"), in place of the one attention launch.
    fused = _per_layer(tmp_path, fused=True, context=triton_attn.PARTITION + 100)
    attention = {k: v for k, v in fused.items() if "attention" in k or "partials" in k}
    assert attention == {"triton:partial_attention_kernel": 1, "triton:merge_partials_kernel": 1}
    assert sum(fused.values()) == triton_layer.LAYER_KERNELS + 1
