"""Greedy output on the device: the torch backend in float32 equals transformers `generate` in
float32 on the same device; flash_attn equals the torch backend in the same half precision; and
speculation (n-gram, a draft model, the target as its own draft) equals speculation off. Where
two runs may round differently, a departure is allowed only at a measured near tie
(`tests.gpu.node.assert_same_greedy`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from tests.gpu.node import (
    FLASH_BF16,
    FLASH_FP16,
    MAX_TOKENS,
    PROMPTS,
    TORCH_FP32,
    Setup,
    Trace,
    assert_same_greedy,
    engine_trace,
    needs_device,
    reference_for,
    transformers_traces,
)

pytestmark = [pytest.mark.gpu, needs_device]


def greedy_traces(model: Path, device: torch.device, setup: Setup, **kwargs: Any) -> list[Trace]:
    """The engine's greedy traces of PROMPTS (batched), leaving no block in use."""
    llm = LLM(str(model), **setup.engine_kwargs(device), **kwargs)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    outputs = llm.generate(PROMPTS, params)
    bm = llm.engine.block_manager
    bm.check_integrity()
    assert bm.num_used_blocks == 0
    return [engine_trace(o.outputs[0]) for o in outputs]


@pytest.fixture(scope="module", params=["gpu_target", "gpu_qwen2"])
def model(request) -> tuple[str, Path]:
    return request.param.removeprefix("gpu_"), request.getfixturevalue(request.param)


@pytest.mark.gpu_check("greedy parity: torch float32 vs transformers")
def test_torch_float32_matches_transformers(model, device, gpu_record):
    name, path = model
    expected = transformers_traces(path, device, PROMPTS, MAX_TOKENS)
    got = greedy_traces(path, device, TORCH_FP32)
    ties = assert_same_greedy(expected, got, TORCH_FP32.tolerance, "torch float32")
    gpu_record(
        f"near-tie departures, torch float32 vs transformers ({name})",
        f"{ties} of {len(PROMPTS)} prompts",
    )


@pytest.mark.gpu_check("greedy parity: flash_attn vs torch, same dtype")
@pytest.mark.parametrize("setup", [FLASH_BF16, FLASH_FP16], ids=lambda s: s.id)
def test_flash_attn_matches_torch(model, device, setup, gpu_record):
    setup.require(device)
    name, path = model
    reference = reference_for(setup)
    expected = greedy_traces(path, device, reference)
    got = greedy_traces(path, device, setup)
    ties = assert_same_greedy(expected, got, setup.tolerance, f"{setup.id} vs {reference.id}")
    gpu_record(
        f"near-tie departures, {setup.id} vs {reference.id} ({name})",
        f"{ties} of {len(PROMPTS)} prompts",
    )


# ----------------------------------------------------------------------------- speculation


@pytest.fixture(scope="module")
def plain(gpu_target, device):
    """Speculation-off traces of the target, per setup (computed once each)."""
    cache: dict[Setup, list[Trace]] = {}

    def get(setup: Setup) -> list[Trace]:
        if setup not in cache:
            cache[setup] = greedy_traces(gpu_target, device, setup)
        return cache[setup]

    return get


def _spec_config(method: str, draft: Path | None) -> dict[str, Any]:
    # "always" keeps k fixed; the random draft is never confident enough for the default early
    # exit, so it drafts full windows.
    config: dict[str, Any] = {
        "method": method,
        "mode": "always",
        "num_speculative_tokens": 4,
        "prompt_lookup_min": 1,
        "draft_min_confidence": 0.0,
    }
    if draft is not None:
        config["model"] = str(draft)
    return config


@pytest.fixture(scope="module")
def gpu_head(gpu_target, tmp_path_factory) -> Path:
    """A random EAGLE-3 head in the published format for the 2-layer target (it taps the
    input of both layers), over half the target's vocabulary."""
    import json

    from tests.eagle3_heads import build_tiny_eagle3_head

    vocab = json.loads((gpu_target / "config.json").read_text())["vocab_size"]
    return build_tiny_eagle3_head(
        tmp_path_factory.mktemp("gpu-head"),
        gpu_target,
        seed=22,
        draft_vocab_size=vocab // 2,
        aux_layer_ids=[0, 1],
    )


@pytest.mark.gpu_check("speculative parity: n-gram, draft model, EAGLE-3 head vs off")
@pytest.mark.parametrize("setup", [TORCH_FP32, FLASH_BF16], ids=lambda s: s.id)
@pytest.mark.parametrize("method", ["ngram", "draft_model", "self_draft", "eagle3"])
def test_greedy_speculation_equals_plain(
    gpu_target, gpu_draft, gpu_head, device, plain, setup, method, gpu_record
):
    setup.require(device)
    draft = {
        "ngram": None,
        "draft_model": gpu_draft,
        "self_draft": gpu_target,
        "eagle3": gpu_head,
    }[method]
    name = method if method in ("ngram", "eagle3") else "draft_model"
    llm = LLM(
        str(gpu_target), **setup.engine_kwargs(device), speculative_config=_spec_config(name, draft)
    )
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params)
    llm.engine.block_manager.check_integrity()
    assert llm.engine.block_manager.num_used_blocks == 0
    got = [Trace(list(o.outputs[0].token_ids), [], [], []) for o in outputs]
    ties = assert_same_greedy(plain(setup), got, setup.tolerance, f"{method} on {setup.id}")

    stats = llm.engine.spec_stats
    assert stats.num_draft_tokens > 0
    if method == "draft_model":
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # rejections happened
    if method == "self_draft" and setup.dtype == "float32":
        # A draft identical to the target is always right (up to float32 noise).
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    if method == "self_draft":
        # In half precision the draft's one-token steps and the target's verify pass may round
        # a near tie differently.
        assert stats.num_accepted_tokens >= 0.8 * stats.num_draft_tokens
    rate = stats.num_accepted_tokens / stats.num_draft_tokens
    gpu_record(
        f"speculation {method}, {setup.id}", f"acceptance {rate:.2f}, near-tie departures {ties}"
    )
