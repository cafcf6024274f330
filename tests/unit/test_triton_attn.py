"""The Triton paged-attention backend on CPU: its kernel checks (tests/unit/triton_interpreted.py)
pass in Triton's interpreter, in a subprocess of their own (TRITON_INTERPRET must be set before
Triton is imported, and leaves no compiled Triton in that process); and the registry offers it on
CUDA nodes, after flash-attn and before the CPU and reference backends."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.attention import AUTO_ORDER, BACKENDS
from engine.config import EngineConfig
from tests.unit.test_config import fake_cuda_node

ROOT = Path(__file__).resolve().parents[2]
CHECKS = Path(__file__).with_name("triton_interpreted.py")

needs_triton = pytest.mark.skipif(
    subprocess.run([sys.executable, "-c", "import triton"], capture_output=True).returncode != 0,
    reason="Triton is not installed (pip install triton): its interpreter runs the kernel on CPU",
)


def run_interpreted(checks: Path, timeout: int = 900) -> None:
    """Run the pytest file `checks` in a subprocess under TRITON_INTERPRET=1: it passes, and
    every check ran (none skipped: a skip would mean the interpreter was not on)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(checks)]
    run = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    report = run.stdout[-8000:] + run.stderr[-2000:]
    assert run.returncode == 0, report
    summary = run.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary, report


@needs_triton
def test_the_kernel_checks_pass_in_the_triton_interpreter():
    run_interpreted(CHECKS)


def test_the_registry_declares_triton_for_cuda():
    spec = BACKENDS["triton"]
    assert spec.device_types == ("cuda",) and not spec.supports_device("cpu")
    assert all(spec.supports_dtype(d) for d in (torch.bfloat16, torch.float16, torch.float32))
    assert spec.default_block_size == 16
    assert all(spec.supports_block_size(b) for b in (16, 32, 256))
    assert not spec.supports_block_size(8)
    # flash-attn first where installed, Triton before the CPU and reference backends.
    assert AUTO_ORDER.index("flash_attn") < AUTO_ORDER.index("triton") < AUTO_ORDER.index("cpu")


def test_auto_on_cuda_without_flash_attn_is_triton(monkeypatch):
    fake_cuda_node(monkeypatch, flash_attn=False, triton=True)
    config = EngineConfig(model="m")
    assert (config.device, config.attention_backend, config.block_size) == ("cuda", "triton", 16)
    # flash-attn still wins where installed; Triton takes what flash-attn refuses.
    fake_cuda_node(monkeypatch, flash_attn=True, triton=True)
    assert EngineConfig(model="m").attention_backend == "flash_attn"
    assert EngineConfig(model="m", dtype="float32").attention_backend == "triton"
    assert EngineConfig(model="m", block_size=16).attention_backend == "triton"
    # Neither: the torch reference.
    fake_cuda_node(monkeypatch, flash_attn=False, triton=False)
    assert EngineConfig(model="m").attention_backend == "torch"


@needs_triton
@pytest.mark.parametrize("max_tokens", [1, 4])
def test_static_metadata_fills_every_graph_size_up_to_a_full_one(max_tokens):
    """A step may fill its graph exactly: as many one-token requests as the largest graph holds
    (a one-sequence engine's only graph, or every request decoding), with no pad row. Each real
    token keeps its request's row, position and slot; padded tokens point at the pad row, whose
    blocks are all the pad block. (On an H200 the one-sequence and the four-decode cases failed.)"""
    from engine.attention import triton_attn
    from tests.attention_cases import make_case

    pad_block = 99
    meta = triton_attn.StaticTritonMetadata(max_tokens, 8, 16, torch.device("cpu"))
    for t in range(1, max_tokens + 1):
        for r in range(1, t + 1):
            case = make_case([1] * r, [3 + 5 * i for i in range(r)], 16)
            meta.fill(case.layout, t, pad_block)
            view = meta.view(t, 1, 1)
            token_seq, token_pos = triton_attn.token_positions(case.layout)
            assert view.token_seq[:r].tolist() == token_seq.tolist()
            assert view.token_pos[:r].tolist() == token_pos.tolist()
            assert view.slot_mapping[:r].tolist() == case.layout.slot_mapping.tolist()
            assert view.token_seq[r:].tolist() == [r] * (t - r)
            assert view.slot_mapping[r:].tolist() == [pad_block * 16 + j for j in range(t - r)]
            for i, blocks in enumerate(case.layout.block_tables):
                assert view.block_table[i, : len(blocks)].tolist() == list(blocks)
            if t > r:
                assert set(view.block_table[r].tolist()) == {pad_block}
