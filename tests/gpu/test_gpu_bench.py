"""A short decode bench on the device, recorded for the summary and never asserted on: batch-1
decode time per token and generated tokens per second with 8 concurrent requests, for the bundled
SmolLM2-135M (the model `make install` brings) in the device's serving setup."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.attention import flash_attn_available
from tests.gpu.node import FLASH_BF16, TORCH_BF16, TORCH_FP32, Setup, needs_device

pytestmark = [pytest.mark.gpu, needs_device, pytest.mark.gpu_check("decode bench (recorded only)")]

MODEL = "smollm2-135m-instruct"
PROMPT = "Write a Python function that merges two sorted lists into one sorted list."
NUM_CONCURRENT = 8


@pytest.fixture(scope="module")
def bench_model(device) -> Path:
    from engine.models.bundled import resolve_model

    try:
        return Path(resolve_model(MODEL))
    except Exception as e:  # not installed: `specserve install-model smollm2-135m-instruct`
        pytest.skip(f"the bundled {MODEL} is not available: {e}")


def _serving_setup(device: torch.device) -> Setup:
    """What a deployment on this device runs: flash_attn in bfloat16 where it can."""
    if device.type != "cuda":
        return TORCH_FP32  # bfloat16 matmuls are slow on CPUs
    return FLASH_BF16 if flash_attn_available() else TORCH_BF16


def _timed(llm: LLM, prompts: list[list[int]], num_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    start = time.perf_counter()  # generate returns tokens on the host: the device is done
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == num_tokens for o in outputs)
    return elapsed


def test_decode_speed(bench_model, device, gpu_record):
    setup = _serving_setup(device)
    llm = LLM(str(bench_model), max_num_seqs=NUM_CONCURRENT, **setup.engine_kwargs(device))
    # A CPU dry run checks that the bench runs, not how fast: keep it short there.
    num_tokens, rounds = (64, 3) if device.type == "cuda" else (8, 1)
    prompt = llm.engine.encode_prompt(PROMPT)
    prompts = [llm.engine.encode_prompt(f"{PROMPT} Variant {i}.") for i in range(NUM_CONCURRENT)]
    _timed(llm, prompts, 4)  # warm-up: kernels, allocator, CUDA graphs

    # Decode cost apart from the prompt's: (t_N - t_1) / (N - 1).
    per_token = statistics.median(
        (_timed(llm, [prompt], num_tokens) - _timed(llm, [prompt], 1)) / (num_tokens - 1)
        for _ in range(rounds)
    )
    concurrent = statistics.median(
        NUM_CONCURRENT * num_tokens / _timed(llm, prompts, num_tokens) for _ in range(rounds)
    )

    # Graphs exist only where the backend can be captured (flash_attn): say what really ran.
    eager = llm.engine.runner.graphs is None
    where = f"{MODEL}, {setup.id}, {'eager' if eager else 'CUDA graphs'}"
    gpu_record(
        f"decode, batch 1 ({where})", f"{per_token * 1e3:.2f} ms/token ({1 / per_token:.0f} tok/s)"
    )
    gpu_record(
        f"decode, {NUM_CONCURRENT} concurrent ({where})",
        f"{concurrent:.0f} tok/s ({NUM_CONCURRENT} x {num_tokens} tokens, prefill included)",
    )
