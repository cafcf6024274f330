"""Tiny random EAGLE-3 heads written straight in the published format (SpecForge's export, as
vLLM and SGLang load it): config.json and model.safetensors with the published tensor names and
shapes, made here from plain tensors and not through engine.models.eagle3.head, so the loader is
checked against the format rather than against itself."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def build_tiny_eagle3_head(
    path: Path,
    target: Path,
    seed: int = 0,
    draft_vocab_size: int | None = None,
    with_embedding: bool = False,
    aux_layer_ids: list[int] | None = None,
    norm_before_residual: bool = False,
    scale: float = 0.08,
    dtype: torch.dtype = torch.bfloat16,
    layout: str = "specforge",
) -> Path:
    """A head for the tiny target saved at `target` (tests/conftest.py build_tiny_model): its
    width, heads and vocabulary; `draft_vocab_size` of the target's ids (every other id from 0,
    then the rest in order: d2t offsets that are not all zero); without an embedding table
    unless `with_embedding` (then the target's is shared). `layout`: "specforge" (SpecForge's
    export) or "speculators" (vllm-project/speculators': the layer's config nested, the head's
    fields at the top, tensors under layers.0.)."""
    cfg = json.loads((target / "config.json").read_text())
    hidden, vocab = cfg["hidden_size"], cfg["vocab_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    inter = cfg["intermediate_size"]
    num_aux = len(aux_layer_ids) if aux_layer_ids else 3
    draft_vocab = draft_vocab_size or vocab
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    def norm(n: int) -> torch.Tensor:
        return (1.0 + 0.1 * torch.randn(n, generator=g)).to(dtype)

    tensors = {
        "fc.weight": rand(hidden, num_aux * hidden),
        "midlayer.self_attn.q_proj.weight": rand(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": rand(hidden, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": rand(inter, hidden),
        "midlayer.mlp.up_proj.weight": rand(inter, hidden),
        "midlayer.mlp.down_proj.weight": rand(hidden, inter),
        "midlayer.input_layernorm.weight": norm(hidden),
        "midlayer.hidden_norm.weight": norm(hidden),
        "midlayer.post_attention_layernorm.weight": norm(hidden),
        "norm.weight": norm(hidden),
        "lm_head.weight": rand(draft_vocab, hidden) * 4,
    }
    # The draft vocabulary: the even ids first, then the odd ones, cut to draft_vocab, sorted.
    used = sorted(([*range(0, vocab, 2), *range(1, vocab, 2)])[:draft_vocab])
    tensors["d2t"] = torch.tensor(used, dtype=torch.int64) - torch.arange(draft_vocab)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[used] = True
    tensors["t2d"] = t2d
    if with_embedding:
        tensors["embed_tokens.weight"] = rand(vocab, hidden)
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "num_hidden_layers": 1,
        "rms_norm_eps": cfg.get("rms_norm_eps", 1e-6),
        "vocab_size": vocab,
        "draft_vocab_size": draft_vocab,
        "max_position_embeddings": cfg.get("max_position_embeddings", 512),
        "rope_theta": cfg.get("rope_theta", 10000.0),
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "bos_token_id": cfg.get("bos_token_id", 1),
        "eos_token_id": cfg.get("eos_token_id", 2),
    }
    if norm_before_residual:
        config["norm_before_residual"] = True
    if aux_layer_ids is not None:
        config["eagle_config"] = {
            "eagle_aux_hidden_state_layer_ids": aux_layer_ids,
            "use_aux_hidden_state": True,
        }
    if layout == "speculators":
        config, tensors = _speculators_layout(config, tensors)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def _speculators_layout(
    config: dict, tensors: dict[str, torch.Tensor]
) -> tuple[dict, dict[str, torch.Tensor]]:
    """The SpecForge-layout head as vllm-project/speculators saves it."""
    head_fields = ("draft_vocab_size", "norm_before_residual")
    layer = {k: v for k, v in config.items() if k not in (*head_fields, "eagle_config")}
    layer["architectures"] = ["LlamaForCausalLM"]
    out = {
        "architectures": ["Eagle3Speculator"],
        "model_type": "speculators",
        "speculators_model_type": "eagle3",
        "transformer_layer_config": layer,
        "draft_vocab_size": config["draft_vocab_size"],
        # Stated: the speculators reading defaults it to true.
        "norm_before_residual": bool(config.get("norm_before_residual", False)),
        "norm_before_fc": False,
        "fc_norm": False,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
            "verifier": {"architectures": ["LlamaForCausalLM"], "name_or_path": "target"},
        },
    }
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is not None:
        out["eagle_aux_hidden_state_layer_ids"] = ids
    renamed = {
        ("layers.0." + k.removeprefix("midlayer.")) if k.startswith("midlayer.") else k: v
        for k, v in tensors.items()
    }
    return out, renamed
