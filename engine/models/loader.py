"""Build a model and fill it from a Hugging Face checkpoint directory (safetensors, sharded or not).

The model is built on the meta device, materialised empty on the target device, and every
parameter is then copied from the checkpoint exactly once; a parameter the checkpoint does not
provide is an error, never a silently random weight.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch
from safetensors import safe_open

from engine.config import ModelConfig
from engine.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

# checkpoint name -> (our parameter name, index of the shard inside a fused parameter or None)
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.(weight|bias)$")


def _safetensors_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}.")
    return files


def _shard_bounds(cfg: ModelConfig, fused: str, shard: int) -> tuple[int, int]:
    if fused == "qkv_proj":
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        sizes = [q, kv, kv]
    else:
        sizes = [cfg.intermediate_size, cfg.intermediate_size]
    start = sum(sizes[:shard])
    return start, start + sizes[shard]


def _target(cfg: ModelConfig, name: str) -> tuple[str, tuple[int, int] | None] | None:
    """Map a checkpoint tensor name to (our parameter name, row range) or None to skip it."""
    if name.endswith("rotary_emb.inv_freq"):
        return None
    if name == "lm_head.weight":
        return None if cfg.tie_word_embeddings else ("lm_head.weight", None)
    match = _LAYER_RE.match(name)
    if match and match.group(3) in _FUSED:
        layer, block, proj, kind = match.groups()
        fused, shard = _FUSED[proj]
        return f"layers.{layer}.{block}.{fused}.{kind}", _shard_bounds(cfg, fused, shard)
    if name.startswith("model."):
        return name[len("model.") :], None
    return name, None


def load_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    """Build `LlamaForCausalLM` for cfg and load its weights from cfg.path."""
    model = LlamaForCausalLM(cfg, dtype)
    model.to_empty(device=device)
    params = dict(model.named_parameters())
    filled: dict[str, int] = {name: 0 for name in params}
    for file in _safetensors_files(cfg.path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                target = _target(cfg, name)
                if target is None:
                    continue
                ours, rows = target
                if ours not in params:
                    raise KeyError(
                        f"checkpoint tensor {name!r} has no place in the model ({ours})."
                    )
                param = params[ours]
                dst = param.data if rows is None else param.data[rows[0] : rows[1]]
                src = f.get_tensor(name)
                if src.shape != dst.shape:
                    raise ValueError(
                        f"{name}: checkpoint shape {tuple(src.shape)} != {tuple(dst.shape)}."
                    )
                dst.copy_(src.to(dtype))
                filled[ours] += src.shape[0] if rows is not None else dst.shape[0]
    missing = [n for n, p in params.items() if filled[n] != p.shape[0]]
    if missing:
        raise ValueError(f"checkpoint {cfg.path} does not provide: {', '.join(missing[:8])}.")
    model.eval()
    logger.info(
        "loaded %s (%s, %d layers, %.0fM parameters) as %s on %s",
        cfg.path.name,
        cfg.architecture,
        cfg.num_layers,
        sum(p.numel() for p in params.values()) / 1e6,
        dtype,
        device,
    )
    return model
