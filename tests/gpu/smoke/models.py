"""Random-weight models made on the machine from a seed: a target of a real model's shape and a
draft that IS the target's first layer(s), so the smoke bench needs no model files to travel.

Speed does not depend on the weights' values, but speculation's does: a random draft would be
rejected at every token, a copy of the target accepted at every one. The draft here is the
target's embedding, first `draft_layers` layers, final norm and (tied) LM head, and the target's
later layers write into the residual stream scaled by `depth_scale`: they move the target's
choice away from the draft's at some positions and not at others, so acceptance lies between 0
and 1 (the bench records it). `RandomModel` holds the two numbers that make it so per shape.

The checkpoint is what our loader reads (engine.models.loader): a transformers config.json and
Hugging Face tensor names in one safetensors file.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class RandomModel:
    """A model shape (transformers Qwen2 config fields) and the random-weight recipe that gives
    its one-layer draft partial acceptance: weights ~ N(0, weight_std), the output projections
    of the layers past the draft's scaled by depth_scale."""

    name: str
    shape: dict[str, Any]
    weight_std: float
    depth_scale: float


# Qwen2.5-1.5B's config (tied embeddings, q/k/v biases, head_dim 128, GQA 6:1). Greedy choices of
# target and draft agree at 0.57 of the positions of random contexts with depth_scale 0.04 (0.78
# at 0.02, 0.16 at 0.1; measured on CPU in float32).
QWEN25_1_5B = RandomModel(
    "qwen2.5-1.5b-shaped",
    dict(
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
    weight_std=0.02,  # transformers' initializer_range: logits of ~0.8 std at hidden 1536
    depth_scale=0.04,
)
# The CPU dry run's stand-in: the same family and tying at a size a CPU runs in seconds. Its
# narrow layers barely move the residual stream, so it needs wider weights: draft acceptance
# 0.38 (mode always, 5 drafts, greedy).
TINY = RandomModel(
    "tiny",
    dict(
        QWEN25_1_5B.shape,
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
    ),
    weight_std=0.08,
    depth_scale=1.0,
)


@dataclass(frozen=True)
class ModelPair:
    """The directories of a target and of its draft, and how they were made."""

    target: Path
    draft: Path
    model: RandomModel
    draft_layers: int
    seed: int


def build_pair(
    root: Path,
    model: RandomModel,
    seed: int,
    dtype: torch.dtype,
    device: torch.device,
    draft_layers: int = 1,
) -> ModelPair:
    """Write target and draft checkpoints under `root` (target/, draft/); tensors are drawn on
    `device` (fast on a GPU) and saved in `dtype`."""
    from safetensors.torch import save_file

    shape = model.shape
    assert 1 <= draft_layers < shape["num_hidden_layers"]
    tensors = dict(_random_tensors(model, seed, dtype, device, draft_layers))
    target, draft = root / "target", root / "draft"
    _write_config(target, shape, dtype)
    save_file(tensors, str(target / "model.safetensors"))
    _write_config(draft, dict(shape, num_hidden_layers=draft_layers), dtype)
    shared = {name: t for name, t in tensors.items() if _layer_of(name) < draft_layers}
    save_file(shared, str(draft / "model.safetensors"))
    return ModelPair(target, draft, model, draft_layers, seed)


def build_head(root: Path, pair: ModelPair, dtype: torch.dtype) -> Path:
    """A random EAGLE-3 head for the pair's target in the published format (tests/
    eagle3_heads.py), under root/head: a draft vocabulary of at most 32k ids, the default taps.
    Its drafts are mostly rejected; the bench runs it in mode always, for what its graphs and
    steps cost, not for speed-up."""
    from tests.eagle3_heads import build_tiny_eagle3_head

    shape = pair.model.shape
    # The default taps (2, L/2, L-3) are three layers from 7 on; below, the first three.
    taps = None if shape["num_hidden_layers"] >= 7 else [0, 1, 2]
    return build_tiny_eagle3_head(
        root / "head",
        pair.target,
        seed=pair.seed,
        draft_vocab_size=min(shape["vocab_size"], 32000),
        aux_layer_ids=taps,
        dtype=dtype,
    )


def _write_config(path: Path, shape: dict[str, Any], dtype: torch.dtype) -> None:
    import transformers

    config = transformers.Qwen2Config(
        **shape, bos_token_id=1, eos_token_id=2, architectures=["Qwen2ForCausalLM"]
    )
    config.dtype = dtype
    config.save_pretrained(path)


def _layer_of(name: str) -> int:
    """The layer a tensor belongs to; -1 for those outside the layers (embedding, norm, head)."""
    parts = name.split(".")
    return int(parts[2]) if parts[:2] == ["model", "layers"] else -1


def _random_tensors(
    model: RandomModel, seed: int, dtype: torch.dtype, device: torch.device, draft_layers: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, CPU tensor) of every weight, drawn in a fixed order from `seed`."""
    shape = model.shape
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    head_dim = hidden // shape["num_attention_heads"]
    q, kv = shape["num_attention_heads"] * head_dim, shape["num_key_value_heads"] * head_dim
    generator = torch.Generator(device=device).manual_seed(seed)

    def normal(*size: int, scale: float = 1.0) -> torch.Tensor:
        t = torch.randn(size, generator=generator, device=device, dtype=torch.float32)
        return (t * (model.weight_std * scale)).to(dtype).cpu()

    def ones(size: int) -> torch.Tensor:
        return torch.ones(size, dtype=dtype)

    yield "model.embed_tokens.weight", normal(shape["vocab_size"], hidden)
    for i in range(shape["num_hidden_layers"]):
        # Layers past the draft's write into the residual stream scaled (module docstring).
        out = 1.0 if i < draft_layers else model.depth_scale
        prefix = f"model.layers.{i}"
        yield f"{prefix}.input_layernorm.weight", ones(hidden)
        for proj, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            yield f"{prefix}.self_attn.{proj}.weight", normal(rows, hidden)
            yield f"{prefix}.self_attn.{proj}.bias", normal(rows)
        yield f"{prefix}.self_attn.o_proj.weight", normal(hidden, q, scale=out)
        yield f"{prefix}.post_attention_layernorm.weight", ones(hidden)
        yield f"{prefix}.mlp.gate_proj.weight", normal(inter, hidden)
        yield f"{prefix}.mlp.up_proj.weight", normal(inter, hidden)
        yield f"{prefix}.mlp.down_proj.weight", normal(hidden, inter, scale=out)
    yield "model.norm.weight", ones(hidden)
    if not shape["tie_word_embeddings"]:
        yield "lm_head.weight", normal(shape["vocab_size"], hidden)
