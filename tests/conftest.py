"""Shared fixtures: tiny random-weight models built in code and saved to a temporary directory."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

if TYPE_CHECKING:
    from engine import LLM

# Tests build throwaway models: their step-time calibrations are not worth caching in ~/.cache.
os.environ.setdefault("SPECSERVE_CALIBRATION_CACHE", "0")

# `make test` runs the suite in two pytest-xdist workers on CI's two cores: each worker's torch
# keeps to one thread, since two OpenMP teams spin-waiting on the same two cores stall each other.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

TINY_VOCAB = 320


_FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
}


def build_tiny_model(path: Path, arch: str, seed: int = 0, **overrides) -> Path:
    """Save a tiny random-weight transformers model (float32) of the given family to `path`."""
    import transformers

    common = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    common.update(overrides)
    torch.manual_seed(seed)
    config_cls, model_cls = _FAMILIES[arch]
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**common))
    # Random init gives near-uniform logits; widen them so greedy choices are well separated.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.05)
    model = model.to(torch.float32).eval()
    model.save_pretrained(path, safe_serialization=True)
    return path


def ngram_llm(model_path: Path, mode: str = "always", **speculative: object) -> LLM:
    """An offline LLM over a tiny model that drafts 3 tokens by n-gram lookup in every step (a
    one-token match is enough; `mode` "always" by default; `speculative` adds to the speculative
    config): float32, 4-token blocks, a 256-token context."""
    from engine import LLM

    config = {
        "method": "ngram",
        "mode": mode,  # "always", a fixed K: the auto policy's choices follow measured times
        "num_speculative_tokens": 3,
        "prompt_lookup_min": 1,
        **speculative,
    }
    return LLM(
        str(model_path),
        dtype="float32",
        block_size=4,
        num_kv_blocks=128,
        max_model_len=256,
        speculative_config=config,
    )


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> Path:
    # Qwen2 with tied embeddings and q/k/v biases: the other branch of the loader.
    return build_tiny_model(
        tmp_path_factory.mktemp("tiny-qwen2"), "qwen2", seed=1, tie_word_embeddings=True
    )
