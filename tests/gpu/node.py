"""Helpers of the GPU-node checks (`make gpu-test`): which device they run on, the attention
setups they compare, and greedy comparison that tells a real divergence from a near tie.

The device is CUDA when torch sees one. `SPECSERVE_GPU_TESTS_DEVICE` overrides it: `cpu` runs the
same checks on the CPU (a dry run of their logic: the flash_attn cases still skip), `cuda` (what
`make gpu-test` sets) makes a node without a usable GPU fail instead of skip.

Why near ties: two correct implementations of the same model in bfloat16 (flash-attn vs the torch
reference, a verify pass over k + 1 tokens vs k + 1 single-token steps) round differently, so
where the best two tokens are nearly tied they may pick different ones, and from there on the
greedy continuations differ legitimately. Everywhere else they must agree. A `Trace` keeps, at
every position of a reference run, its token, the runner-up and the logprob margin between them,
so `assert_same_greedy` can allow a departure only at a position that really is a near tie.
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.attention import flash_attn_available, triton_available
from engine.outputs import CompletionOutput

DEVICE_ENV = "SPECSERVE_GPU_TESTS_DEVICE"
VOCAB = 320  # the tiny models' vocabulary (tests.conftest.TINY_VOCAB)


def requested_device() -> str | None:
    """$SPECSERVE_GPU_TESTS_DEVICE, else "cuda" when torch sees a GPU, else None (skip)."""
    return os.environ.get(DEVICE_ENV) or ("cuda" if torch.cuda.is_available() else None)


# Module-level marker of every GPU-node test: decided at import, so CI skips without building
# any model.
needs_device = pytest.mark.skipif(
    requested_device() is None, reason=f"needs CUDA (or {DEVICE_ENV}=cpu for a CPU dry run)"
)


@dataclass(frozen=True)
class Setup:
    """An attention backend with the dtype and KV page size it runs in, and the numerical noise
    (in logprob) two correct runs of one model in this dtype may show between each other."""

    backend: str
    dtype: str
    block_size: int
    tolerance: float

    @property
    def id(self) -> str:
        return f"{self.backend}-{self.dtype}"

    def require(self, device: torch.device) -> None:
        """Skip the calling test where this setup cannot run."""
        if self.backend == "flash_attn" and not (device.type == "cuda" and flash_attn_available()):
            pytest.skip("flash_attn needs CUDA and the flash-attn package")
        if self.backend == "triton" and not (device.type == "cuda" and triton_available()):
            pytest.skip("the triton backend needs CUDA and Triton")

    def engine_kwargs(self, device: torch.device, **overrides: Any) -> dict[str, Any]:
        """`LLM` keyword arguments: everything explicit (no default of the engine's is relied
        on), and a small KV pool (an unsized pool on CUDA would take most of the GPU)."""
        kwargs: dict[str, Any] = dict(
            device=str(device),
            dtype=self.dtype,
            attention_backend=self.backend,
            block_size=self.block_size,
            num_kv_blocks=max(8, 8192 // self.block_size),
            max_model_len=1024,
        )
        kwargs.update(overrides)
        return kwargs


# Noise between two correct runs of the tiny models, measured on CPU: float32 ~1e-5 (1e-3 leaves
# room for GPU kernels); bfloat16 up to 0.017 between two chunkings and 0.03 against float32;
# float16 up to 0.002 and 0.004. The random models' median top-2 margin is ~0.2, so these
# tolerances leave most positions no room to depart.
TORCH_FP32 = Setup("torch", "float32", 16, 1e-3)
TORCH_BF16 = Setup("torch", "bfloat16", 16, 0.05)
TORCH_FP16 = Setup("torch", "float16", 16, 0.01)
FLASH_BF16 = Setup("flash_attn", "bfloat16", 256, 0.05)
FLASH_FP16 = Setup("flash_attn", "float16", 256, 0.01)
# The Triton backend in flash-attn's page size: the graph checks' block tables hold for both.
TRITON_BF16 = Setup("triton", "bfloat16", 256, 0.05)


def reference_for(setup: Setup) -> Setup:
    """The torch backend in the same dtype: what another setup is held against."""
    return {"float32": TORCH_FP32, "bfloat16": TORCH_BF16, "float16": TORCH_FP16}[setup.dtype]


def make_prompts() -> list[list[int]]:
    """Short and long prompts (a 300-token one is prefilled in chunks and spans two 256-token
    pages), two sharing a 40-token prefix (prefix-cache hits) and one that repeats itself (n-gram
    drafts find matches)."""
    rng = random.Random(11)
    shared = [rng.randrange(3, VOCAB) for _ in range(40)]
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (1, 7, 19, 245, 300)]
    prompts += [shared + [5, 6, 7], shared + [8], [9, 10, 11, 12, 13] * 6]
    return prompts


PROMPTS = make_prompts()
MAX_TOKENS = 24


@dataclass(frozen=True)
class Trace:
    """One greedy output and, at each of its positions, the runner-up token and the logprob
    margin of the chosen token over it (empty when unknown)."""

    token_ids: list[int]
    logprobs: list[float]
    runner_up_ids: list[int]
    margins: list[float]


def engine_trace(output: CompletionOutput) -> Trace:
    """The trace of an engine completion generated with `logprobs=2` (or just its tokens)."""
    entries = output.logprobs or []
    return Trace(
        token_ids=list(output.token_ids),
        logprobs=[e.logprob for e in entries],
        runner_up_ids=[e.top_token_ids[1] for e in entries],
        margins=[e.top_logprobs[0] - e.top_logprobs[1] for e in entries],
    )


def transformers_traces(
    model_dir: Path, device: torch.device, prompts: Sequence[Sequence[int]], max_tokens: int
) -> list[Trace]:
    """Greedy float32 `generate` on `device`, one prompt at a time, with the margins."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    model.generation_config.eos_token_id = None  # the engine runs with ignore_eos
    traces = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(
                torch.tensor([list(prompt)], device=device),
                max_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=0,
                output_logits=True,
                return_dict_in_generate=True,
            )
            logprobs = torch.stack(out.logits)[:, 0].float().log_softmax(-1)  # [steps, vocab]
            token_ids = out.sequences[0, len(prompt) :]  # [steps]
            top = logprobs.topk(2, dim=-1)  # [steps, 2] each
            traces.append(
                Trace(
                    token_ids=token_ids.tolist(),
                    logprobs=logprobs.gather(1, token_ids[:, None])[:, 0].tolist(),
                    runner_up_ids=top.indices[:, 1].tolist(),
                    margins=(top.values[:, 0] - top.values[:, 1]).tolist(),
                )
            )
    del model
    return traces


def assert_same_greedy(
    references: Sequence[Trace], candidates: Sequence[Trace], tolerance: float, what: str
) -> int:
    """Every candidate equals its reference token for token, except that it may leave it at a
    near tie: a position where the reference's margin is within 2 * tolerance (each run's logprobs
    may move by `tolerance`) and the candidate took the reference's runner-up. Up to the first
    departure, logprobs (where both traces have them) agree within `tolerance`. Returns the
    number of near-tie departures."""
    departures = 0
    for i, (ref, cand) in enumerate(zip(references, candidates, strict=True)):
        assert len(cand.token_ids) == len(ref.token_ids), f"{what}: prompt {i}: length differs"
        pos = _first_difference(ref.token_ids, cand.token_ids)
        end = len(ref.token_ids) if pos is None else pos
        if ref.logprobs and cand.logprobs:
            pairs = zip(ref.logprobs[:end], cand.logprobs[:end], strict=True)
            worst = max((abs(a - b) for a, b in pairs), default=0.0)
            assert worst <= tolerance, f"{what}: prompt {i}: logprobs differ by {worst:.3g}"
        if pos is None:
            continue
        margin = ref.margins[pos] if ref.margins else float("inf")
        is_tie = margin <= 2 * tolerance and cand.token_ids[pos] == ref.runner_up_ids[pos]
        assert is_tie, (
            f"{what}: prompt {i} diverged at token {pos}: {cand.token_ids[pos]} instead of "
            f"{ref.token_ids[pos]} (reference margin {margin:.3g}, tolerance {tolerance:g})"
        )
        departures += 1
    return departures


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
