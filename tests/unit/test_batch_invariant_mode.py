"""`batch_invariant`: the configuration resolves it once, at start (CUDA: the Triton attention
backend, whatever else is installed; CPU: our kernels' backend, which must have built; any other
backend asked for is a clear error); the runner switches a CUDA model's every product and norm to
the Triton kernels and leaves the CPU's (batch-invariant already) as they are; a module the
switch does not know is an error. The kernels' own checks run in Triton's interpreter
(tests/unit/triton_invariant_interpreted.py), in a subprocess of their own."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import engine.execution.runner
from engine import LLM
from engine.config import EngineConfig
from engine.execution.runner import ModelRunner
from engine.models.linears import Linear, enable_batch_invariant
from engine.models.llama import MLP, RMSNorm
from tests.gguf_models import build_tiny_gguf_model
from tests.unit.test_config import cpu_node, fake_cuda_node
from tests.unit.test_triton_attn import needs_triton, run_interpreted

ROOT = Path(__file__).resolve().parents[2]
CHECKS = Path(__file__).with_name("triton_invariant_interpreted.py")


@needs_triton
def test_the_kernel_checks_pass_in_the_triton_interpreter():
    run_interpreted(CHECKS)


def test_on_cuda_it_takes_the_triton_attention_even_where_flash_attn_is_installed(monkeypatch):
    fake_cuda_node(monkeypatch, flash_attn=True, triton=True)
    assert EngineConfig(model="m").attention_backend == "flash_attn"
    config = EngineConfig(model="m", batch_invariant=True)
    assert (config.device, config.attention_backend, config.block_size) == ("cuda", "triton", 16)
    explicit = EngineConfig(model="m", batch_invariant=True, attention_backend="triton")
    assert explicit.attention_backend == "triton"


@pytest.mark.parametrize("backend", ["flash_attn", "torch"])
def test_on_cuda_another_attention_backend_is_refused(monkeypatch, backend):
    fake_cuda_node(monkeypatch, flash_attn=True, triton=True)
    with pytest.raises(ValueError, match="batch_invariant on cuda needs attention_backend triton"):
        EngineConfig(model="m", batch_invariant=True, attention_backend=backend)


def test_on_cuda_without_triton_it_says_so(monkeypatch):
    fake_cuda_node(monkeypatch, flash_attn=True, triton=False)
    with pytest.raises(ValueError, match="triton"):
        EngineConfig(model="m", batch_invariant=True)


def test_on_cpu_it_needs_our_kernels(monkeypatch):
    cpu_node(monkeypatch, kernels=True)
    assert EngineConfig(model="m", batch_invariant=True).attention_backend == "cpu"
    with pytest.raises(ValueError, match="batch_invariant on cpu needs attention_backend cpu"):
        EngineConfig(model="m", batch_invariant=True, attention_backend="torch")
    cpu_node(monkeypatch, kernels=False)
    assert EngineConfig(model="m").attention_backend == "torch"  # without the mode: fine
    with pytest.raises(ValueError, match="kernels"):
        EngineConfig(model="m", batch_invariant=True)


def test_the_switch_reaches_every_product_and_norm(tiny_qwen2):
    llm = LLM(str(tiny_qwen2), dtype="float32", quantization="none", num_kv_blocks=16)
    model = llm.engine.runner.model
    enable_batch_invariant(model)
    switchable = [m for m in model.modules() if isinstance(m, (Linear, RMSNorm, MLP))]
    assert switchable and all(m.batch_invariant for m in switchable)
    assert model.batch_invariant  # its LM head's product (tied here: the embedding's weight)


def test_a_module_the_switch_does_not_know_is_an_error():
    model = nn.Sequential(Linear(4, 4), nn.Linear(4, 4))
    with pytest.raises(ValueError, match="1: Linear has no batch-invariant route"):
        enable_batch_invariant(model)
    with pytest.raises(ValueError, match="LayerNorm has no batch-invariant route"):
        enable_batch_invariant(nn.Sequential(nn.LayerNorm(4)))


def test_gguf_blocks_are_refused(tmp_path):
    path = build_tiny_gguf_model(tmp_path, "llama", seed=0)
    llm = LLM(str(path), quantization="gguf", num_kv_blocks=16)
    with pytest.raises(ValueError, match="GGUF blocks have no batch-invariant GPU kernel"):
        enable_batch_invariant(llm.engine.runner.model)


@pytest.mark.parametrize("cuda", [True, False])
def test_the_runner_switches_a_cuda_model_only(tiny_llama, monkeypatch, cuda):
    # The runner is built on this CPU; only its device's answer to "is this CUDA?" is faked.
    monkeypatch.setattr(engine.execution.runner.Device, "is_cuda", property(lambda self: cuda))
    config = EngineConfig(
        model=str(tiny_llama), dtype="float32", quantization="none", batch_invariant=True
    )
    from engine.models.config import ModelConfig

    runner = ModelRunner(config, ModelConfig.from_path(tiny_llama), 64, torch.float32)
    flags = {m.batch_invariant for m in runner.model.modules() if isinstance(m, (Linear, RMSNorm))}
    assert flags == {cuda}
