"""Rotary position embeddings: the cos/sin tables of a checkpoint's RoPE (default, llama3 and the
scalings transformers computes), looked up per step by position, and their application to q and k.
"""

from __future__ import annotations

import math
from typing import Any

import torch


class RotaryEmbedding:
    """cos/sin tables for every position, computed once, theta and scaling from the checkpoint's
    config in either transformers form: 5.x's `rope_parameters`, or 4.x's `rope_scaling` with
    `rope_theta` at the top (pyproject allows both). default, linear and llama3 are computed here;
    yarn, longrope and the other types transformers' initialisers know go through them; any other
    type raises rather than falling back to unscaled frequencies (wrong output past the first
    few hundred positions: Llama 3.x's llama3 scaling)."""

    def __init__(self, hf_config: Any, head_dim: int, max_positions: int, device: torch.device):
        params = self.rope_parameters(hf_config)
        rope_type = params["rope_type"]
        theta = float(params["rope_theta"])
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float, device="cpu") / head_dim
        inv_freq = 1.0 / (theta**exponents)  # [head_dim / 2]
        scaling = 1.0
        if rope_type == "linear":
            inv_freq = inv_freq / float(params["factor"])
        elif rope_type == "llama3":
            inv_freq = self.llama3_inv_freq(inv_freq, params)
        elif rope_type == "dynamic":
            # Dynamic NTK changes theta only past the trained length; a fixed table cannot.
            trained = int(
                params.get("original_max_position_embeddings", 0)
                or getattr(hf_config, "max_position_embeddings", 0)
            )
            if max_positions > trained:
                raise ValueError(
                    f"rope type 'dynamic' rescales past {trained} positions, which specserve's "
                    f"fixed tables do not: set max_model_len <= {trained}."
                )
        elif rope_type != "default":
            inv_freq, scaling = self.transformers_inv_freq(hf_config, rope_type)
        self.inv_freq = inv_freq  # [head_dim / 2]
        # Tables are computed on the host once, then kept on the device.
        positions = torch.arange(max_positions, dtype=torch.float, device="cpu")
        freqs = positions[:, None] * inv_freq[None, :]  # [max_positions, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
        self.cos = (emb.cos() * scaling).to(device)
        self.sin = (emb.sin() * scaling).to(device)

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)

    @staticmethod
    def rope_parameters(hf_config: Any) -> dict[str, Any]:
        """The config's RoPE settings in transformers 5's form: rope_type, rope_theta and the
        scaling keys, from `rope_parameters` (5.x), else `rope_scaling` + `rope_theta` (4.x,
        whose older entries name the type `type`)."""
        given = getattr(hf_config, "rope_parameters", None)
        params = dict(given or getattr(hf_config, "rope_scaling", None) or {})
        params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", None) or 10000.0)
        return params

    @staticmethod
    def llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
        """Llama 3.1's scaling: wavelengths shorter than trained / high_freq_factor stay, longer
        than trained / low_freq_factor are divided by factor, and those between blend the two."""
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        trained = float(params["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq  # [head_dim / 2]
        smooth = (trained / wavelen - low) / (high - low)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        scaled = torch.where(wavelen > trained / low, inv_freq / factor, blended)
        return torch.where(wavelen < trained / high, inv_freq, scaled)

    @staticmethod
    def transformers_inv_freq(hf_config: Any, rope_type: str) -> tuple[torch.Tensor, float]:
        """(inv_freq, attention scaling) from the installed transformers' initialiser, which
        reads the config in its own version's form (the one AutoConfig loaded it in)."""
        import transformers
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        if rope_type not in ROPE_INIT_FUNCTIONS:
            raise ValueError(
                f"unsupported rope type {rope_type!r}: specserve computes default, linear, "
                f"llama3 and dynamic; transformers {transformers.__version__} knows "
                f"{', '.join(sorted(ROPE_INIT_FUNCTIONS))}."
            )
        try:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
        except (AttributeError, KeyError, TypeError) as e:
            raise ValueError(
                f"rope type {rope_type!r}: transformers {transformers.__version__} could not "
                f"read this config ({e!r})."
            ) from e
        return inv_freq.float(), float(scaling)
