"""An EAGLE-3 head's config.json, read as vLLM and SGLang read it, with its checks against the
target; and the config SpecForge writes for a new head (`head_config_dict`).

SpecForge's layout: `architectures: ["LlamaForCausalLMEagle3"]`, `num_hidden_layers: 1`, the usual
Llama fields, `vocab_size` = the target's, `draft_vocab_size`, optionally `target_hidden_size`
and `eagle_config.eagle_aux_hidden_state_layer_ids`. The same head in vllm-project/speculators'
layout (architectures `Eagle3Speculator`, `speculators_model_type: eagle3`, the layer's fields
nested in `transformer_layer_config`, `eagle_aux_hidden_state_layer_ids` and the head's flags at
the top, `norm_before_residual` true unless it says otherwise) is read as vLLM reads it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.models.config import ModelConfig

HEAD_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


# Keys other than these in config.json change the forward in ways this loader does not know; a
# head that sets one to a value other than its default is refused rather than served wrong.
_UNSUPPORTED_FLAGS = {"fc_norm": False, "mlp_bias": False, "norm_before_fc": False,
                      "norm_output": False}  # fmt: skip


# vllm-project/speculators' layout of the same head: architectures ["Eagle3Speculator"] (or
# its draft model's class), `speculators_model_type: eagle3`, the decoder layer's Llama fields
# nested in `transformer_layer_config`, the head's own fields at the top (the tapped layers as
# `eagle_aux_hidden_state_layer_ids`), tensors under `layers.0.` rather than `midlayer.`.
SPECULATORS_ARCHITECTURES = ("Eagle3Speculator", "Eagle3DraftModel")


_SPECULATORS_FIELDS = ("draft_vocab_size", "target_hidden_size", "norm_before_residual",
                       *_UNSUPPORTED_FLAGS)  # fmt: skip


@dataclass(frozen=True)
class Eagle3Config:
    """A head's config.json, read as vLLM and SGLang read it."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...] | None  # None: the default for the target's depth
    attention_bias: bool = False
    norm_before_residual: bool = False
    path: Path | None = None
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], path: Path | None = None) -> Eagle3Config:
        where = f"EAGLE-3 head {path}" if path else "EAGLE-3 head"
        raw = _from_speculators(raw, where)
        archs = list(raw.get("architectures") or [])
        if not any(a in HEAD_ARCHITECTURES for a in archs):
            raise ValueError(
                f"{where}: config.json architectures {archs} name no EAGLE-3 head "
                f"(expected {HEAD_ARCHITECTURES[0]!r})."
            )
        if int(raw.get("num_hidden_layers", 1)) != 1:
            raise ValueError(
                f"{where}: num_hidden_layers is {raw['num_hidden_layers']}; an EAGLE-3 head "
                "has one decoder layer."
            )
        for key, default in _UNSUPPORTED_FLAGS.items():
            if bool(raw.get(key, default)) != default:
                raise ValueError(f"{where}: {key}={raw[key]!r} is not supported.")
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        eagle = raw.get("eagle_config") or {}
        ids = eagle.get("eagle_aux_hidden_state_layer_ids")
        vocab = int(raw["vocab_size"])
        return cls(
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            vocab_size=vocab,
            draft_vocab_size=int(raw.get("draft_vocab_size") or vocab),
            target_hidden_size=int(raw.get("target_hidden_size") or hidden),
            aux_layer_ids=tuple(int(i) for i in ids) if ids else None,
            attention_bias=bool(raw.get("attention_bias", False)),
            norm_before_residual=bool(raw.get("norm_before_residual", False)),
            path=path,
            raw=dict(raw),
        )

    @classmethod
    def from_path(cls, path: str | Path) -> Eagle3Config:
        path = Path(path)
        file = path / "config.json"
        if not file.is_file():
            raise ValueError(f"EAGLE-3 head {path}: no config.json.")
        return cls.from_dict(json.loads(file.read_text()), path)

    def aux_layers(self, num_target_layers: int) -> tuple[int, ...]:
        """The target layers whose input the head reads: the head's own, else the default."""
        if self.aux_layer_ids is not None:
            return self.aux_layer_ids
        n = num_target_layers
        return (2, n // 2, n - 3)

    def check_target(self, target: ModelConfig) -> None:
        """ValueError naming the first way this head does not fit the target."""
        where = f"EAGLE-3 head {self.path or ''}".rstrip()
        if self.target_hidden_size != target.hidden_size:
            raise ValueError(
                f"{where} reads target hidden states of size {self.target_hidden_size}; the "
                f"target {target.path.name} has hidden_size {target.hidden_size}."
            )
        if self.vocab_size != target.vocab_size:
            raise ValueError(
                f"{where} has vocab_size {self.vocab_size}; the target {target.path.name} has "
                f"{target.vocab_size}: a head is trained for one target's vocabulary."
            )
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"{where}: draft_vocab_size {self.draft_vocab_size} is not within [1, "
                f"vocab_size {self.vocab_size}]."
            )
        layers = self.aux_layers(target.num_layers)
        bad = [i for i in layers if not 0 <= i < target.num_layers]
        if not layers or bad:
            raise ValueError(
                f"{where} taps target layers {list(layers)}; the target has {target.num_layers} "
                f"layers, so each must be in [0, {target.num_layers})."
            )
        if len(set(layers)) != len(layers):
            raise ValueError(f"{where} taps target layers {list(layers)}: one is named twice.")

    def as_model_config(self, target: ModelConfig) -> ModelConfig:
        """The head as the runner sizes it: one layer of KV, the target's vocabulary (the rows
        the verifier compares), RoPE from the head's own config."""
        from transformers import LlamaConfig

        raw = {k: v for k, v in self.raw.items() if k not in ("architectures", "eagle_config")}
        hf = LlamaConfig.from_dict(raw)
        return ModelConfig(
            path=self.path or target.path,
            architecture=HEAD_ARCHITECTURES[0],
            vocab_size=target.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_layers=1,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=int(self.raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=False,
            attention_bias=self.attention_bias,
            qk_norm=False,
            torch_dtype=str(self.raw.get("torch_dtype") or "bfloat16"),
            eos_token_ids=target.eos_token_ids,
            hf_config=hf,
        )


def _from_speculators(raw: Mapping[str, Any], where: str) -> Mapping[str, Any]:
    """A speculators-layout config.json as the SpecForge layout says the same head (vLLM's
    reading: `norm_before_residual` defaults to true there); any other config as it is."""
    archs = list(raw.get("architectures") or [])
    if raw.get("speculators_model_type") is None and not any(
        a in SPECULATORS_ARCHITECTURES for a in archs
    ):
        return raw
    if raw.get("speculators_model_type") not in (None, "eagle3"):
        raise ValueError(
            f"{where}: speculators_model_type {raw['speculators_model_type']!r} is not an "
            "EAGLE-3 head (expected 'eagle3')."
        )
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, Mapping):
        raise ValueError(f"{where}: a speculators config needs transformer_layer_config.")
    flat = {k: v for k, v in layer.items() if k not in ("architectures", "eagle_config")}
    flat.update({k: raw[k] for k in _SPECULATORS_FIELDS if raw.get(k) is not None})
    flat.setdefault("norm_before_residual", True)
    flat["architectures"] = [HEAD_ARCHITECTURES[0]]
    ids = raw.get("eagle_aux_hidden_state_layer_ids")
    if ids:
        flat["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(ids)}
    return flat


def head_config_dict(
    target: ModelConfig,
    draft_vocab_size: int,
    aux_layer_ids: tuple[int, ...] | None = None,
    intermediate_size: int | None = None,
    max_position_embeddings: int | None = None,
) -> dict[str, Any]:
    """config.json of a head for `target` as SpecForge writes one: the target's width, heads and
    RoPE (its scaling too: a Llama 3.1 target's llama3 frequencies), one layer, the draft
    vocabulary's size, and the tapped layers when given."""
    rope = dict(getattr(target.hf_config, "rope_parameters", None) or {})
    theta = rope.get("rope_theta") or getattr(target.hf_config, "rope_theta", None) or 10000.0
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    scaling = scaling or dict(getattr(target.hf_config, "rope_scaling", None) or {})
    raw: dict[str, Any] = {
        "architectures": [HEAD_ARCHITECTURES[0]],
        "model_type": "llama",
        "hidden_size": target.hidden_size,
        "intermediate_size": intermediate_size or target.intermediate_size,
        "num_attention_heads": target.num_heads,
        "num_key_value_heads": target.num_kv_heads,
        "head_dim": target.head_dim,
        "num_hidden_layers": 1,
        "rms_norm_eps": target.rms_norm_eps,
        "vocab_size": target.vocab_size,
        "draft_vocab_size": draft_vocab_size,
        "target_hidden_size": target.hidden_size,
        "max_position_embeddings": max_position_embeddings or target.max_position_embeddings,
        "rope_theta": float(theta),
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    if scaling.get("rope_type", scaling.get("type", "default")) != "default":
        raw["rope_scaling"] = scaling
    if aux_layer_ids is not None:
        raw["eagle_config"] = {
            "eagle_aux_hidden_state_layer_ids": list(aux_layer_ids),
            "use_aux_hidden_state": True,
        }
    return raw
