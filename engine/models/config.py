"""`ModelConfig`: the architecture of a Llama-family checkpoint, read from its config.json.

What the checkpoint says, never what the user asked for (that is `engine.config.EngineConfig`);
nothing writes to it after construction.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.text.tokenizer import config_eos_token_ids

# Architectures our Llama-family implementation serves, mapped to the knobs that tell them apart.
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of a Llama-family checkpoint, read from its config.json."""

    path: Path
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    torch_dtype: str
    eos_token_ids: tuple[int, ...]
    hf_config: Any = field(repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads.")

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V cache one token takes across all layers, per byte of dtype."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    @classmethod
    def from_path(cls, path: str | Path) -> ModelConfig:
        from transformers import AutoConfig

        path = Path(path)
        hf = AutoConfig.from_pretrained(path, local_files_only=True)
        archs = getattr(hf, "architectures", None) or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or hf.model_type!r}; "
                f"specserve serves {', '.join(SUPPORTED_ARCHITECTURES)}."
            )
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        raw = json.loads((path / "config.json").read_text())
        return cls(
            path=path,
            architecture=arch,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=hf.num_attention_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            # Qwen2 has q/k/v biases without saying so in its config.
            attention_bias=bool(getattr(hf, "attention_bias", arch == "Qwen2ForCausalLM")),
            qk_norm=arch == "Qwen3ForCausalLM",
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"),
            eos_token_ids=config_eos_token_ids(path),
            hf_config=hf,
        )
