"""What the EAGLE-3 head tests share: a 4-layer tiny target (the test modules wrap build_target in
their `target` fixture), a head for it in the published format tapping its layers 1, 2 and 3,
and an engine that drafts 3 tokens a step with that head whatever their confidence."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM
from tests.conftest import build_tiny_model
from tests.eagle3_heads import build_tiny_eagle3_head

LAYERS = 4
TAPS = [1, 2, 3]


def build_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(
        tmp_path_factory.mktemp("eagle3-target"), "llama", seed=3, num_hidden_layers=LAYERS
    )


def _head(tmp_path, target, **kwargs):
    kwargs.setdefault("aux_layer_ids", TAPS)
    return build_tiny_eagle3_head(tmp_path / "head", target, **kwargs)


def _llm(target, head, **spec):
    return LLM(
        str(target),
        dtype="float32",
        block_size=4,
        num_kv_blocks=64,
        max_model_len=128,
        speculative_config={
            "method": "eagle3",
            "model": str(head),
            "mode": "always",
            "num_speculative_tokens": 3,
            "draft_min_confidence": 0.0,
            **spec,
        },
    )
