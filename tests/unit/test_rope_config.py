"""RoPE scaling read from either transformers form (issue 33, F8).

transformers 5 keeps theta and scaling in `config.rope_parameters`; transformers 4 (which
pyproject allows) in `config.rope_scaling` with `rope_theta` at the top. Reading only the first
silently dropped Llama 3.x's llama3 scaling under transformers 4. The expected llama3
frequencies are computed here from the published formula, element by element in float64.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from engine.models.rope import RotaryEmbedding

HEAD_DIM = 64
THETA = 500000.0
LLAMA3 = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
SHAPE = dict(hidden_size=256, num_attention_heads=4, head_dim=HEAD_DIM)


def v4_config(rope_scaling: dict | None, **extra) -> SimpleNamespace:
    """A transformers-4 config: scaling in rope_scaling, theta at the top, no rope_parameters."""
    return SimpleNamespace(
        rope_scaling=rope_scaling,
        rope_theta=THETA,
        max_position_embeddings=131072,
        **SHAPE,
        **extra,
    )


def v5_config(rope_type: str, scaling: dict) -> SimpleNamespace:
    """A transformers-5 config: everything in rope_parameters."""
    params = {"rope_type": rope_type, "rope_theta": THETA, **scaling}
    return SimpleNamespace(rope_parameters=params, max_position_embeddings=131072, **SHAPE)


def inv_freq(config) -> torch.Tensor:
    """The inverse frequencies the rope tables were built from: position 1's angles."""
    rope = RotaryEmbedding(config, HEAD_DIM, 4, torch.device("cpu"))
    return torch.atan2(rope.sin[1, : HEAD_DIM // 2], rope.cos[1, : HEAD_DIM // 2])


def unscaled() -> list[float]:
    return [1.0 / THETA ** (i / HEAD_DIM) for i in range(0, HEAD_DIM, 2)]


def llama3_expected() -> torch.Tensor:
    """Llama 3.1's frequency scaling as Meta published it (apply_scaling)."""
    factor, low, high = LLAMA3["factor"], LLAMA3["low_freq_factor"], LLAMA3["high_freq_factor"]
    old_len = LLAMA3["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    scaled = []
    for freq in unscaled():
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            scaled.append(freq)
        elif wavelen > low_freq_wavelen:
            scaled.append(freq / factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            scaled.append((1 - smooth) * freq / factor + smooth * freq)
    return torch.tensor(scaled, dtype=torch.float64)


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual.double(), expected.double(), rtol=1e-5, atol=1e-9)


def test_llama3_scaling_in_the_transformers_4_form_is_applied():
    expected = llama3_expected()
    assert not torch.allclose(expected, torch.tensor(unscaled(), dtype=torch.float64))
    _close(inv_freq(v4_config({"rope_type": "llama3", **LLAMA3})), expected)
    _close(inv_freq(v5_config("llama3", LLAMA3)), expected)


def test_linear_scaling_in_either_form():
    expected = torch.tensor(unscaled(), dtype=torch.float64) / 4.0
    _close(inv_freq(v4_config({"type": "linear", "factor": 4.0})), expected)  # 4.x's old key
    _close(inv_freq(v5_config("linear", {"factor": 4.0})), expected)


def test_no_scaling_in_either_form():
    expected = torch.tensor(unscaled(), dtype=torch.float64)
    _close(inv_freq(v4_config(None)), expected)
    _close(inv_freq(v5_config("default", {})), expected)


def test_the_installed_transformers_config_gives_the_same_frequencies():
    from transformers import LlamaConfig

    config = LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        max_position_embeddings=131072,
        rope_theta=THETA,
        rope_scaling={"rope_type": "llama3", **LLAMA3},
    )
    _close(inv_freq(config), llama3_expected())


def test_an_unsupported_rope_type_raises():
    with pytest.raises(ValueError, match="rope type 'made_up'"):
        inv_freq(v4_config({"rope_type": "made_up", "factor": 2.0}))
    with pytest.raises(ValueError, match="rope type 'made_up'"):
        inv_freq(v5_config("made_up", {"factor": 2.0}))
