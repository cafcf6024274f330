"""An EAGLE-3 head's files: reading its tensors into an `Eagle3Head` in the published shapes,
and writing one back (`save_head`) in the format vLLM's and SGLang's loaders read.

A head directory holds `config.json` (engine/models/eagle3/config.py) and safetensors (or, as the
original EAGLE releases ship, pytorch_model.bin) with exactly these tensors:

    fc.weight                                 [H, n_aux * H_target]
    midlayer.self_attn.{q,k,v}_proj.weight    [heads * head_dim, 2H]  (k, v: kv heads)
    midlayer.self_attn.o_proj.weight          [H, heads * head_dim]
    midlayer.mlp.{gate,up}_proj.weight        [I, H];  midlayer.mlp.down_proj.weight [H, I]
    midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight  [H]
    norm.weight [H];  lm_head.weight [draft_vocab, H]
    d2t int64 [draft_vocab]: an OFFSET, target id = draft id + d2t[draft id]
    t2d bool [vocab]: which target ids the draft vocabulary holds (not read when serving)
    embed_tokens.weight [vocab, H]: optional; without it the target's embedding is shared

vllm-project/speculators' layout keeps them under `layers.0.` rather than `midlayer.`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from engine.models.config import ModelConfig
from engine.models.eagle3.config import Eagle3Config
from engine.models.eagle3.head import Eagle3Head

# Checkpoint name -> (our parameter, rows of it) for the fused projections.
_FUSED = {
    "midlayer.self_attn.q_proj": ("midlayer.self_attn.qkv_proj", 0),
    "midlayer.self_attn.k_proj": ("midlayer.self_attn.qkv_proj", 1),
    "midlayer.self_attn.v_proj": ("midlayer.self_attn.qkv_proj", 2),
    "midlayer.mlp.gate_proj": ("midlayer.mlp.gate_up_proj", 0),
    "midlayer.mlp.up_proj": ("midlayer.mlp.gate_up_proj", 1),
}


REQUIRED_KEYS = (
    "fc.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.post_attention_layernorm.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
)


def _canonical(name: str) -> str:
    """Names as SpecForge exports them; some exports prefix `model.` or call the layer
    `layers.0`."""
    name = name.removeprefix("model.")
    if name.startswith("layers.0."):
        name = "midlayer." + name.removeprefix("layers.0.")
    return name


def read_head_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) for every tensor of the head directory's safetensors (or
    pytorch_model.bin, as the original EAGLE releases ship)."""
    files = sorted(path.glob("*.safetensors"))
    if files:
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    yield _canonical(name), f.get_tensor(name)
        return
    bins = sorted(path.glob("*.bin"))
    if not bins:
        raise ValueError(f"EAGLE-3 head {path}: no *.safetensors (or *.bin) weights.")
    for file in bins:
        for name, tensor in torch.load(file, map_location="cpu", weights_only=True).items():
            yield _canonical(name), tensor


def load_head(
    head: Eagle3Config,
    cfg: ModelConfig,
    num_aux: int,
    dtype: torch.dtype,
    device: torch.device,
    tensors: Mapping[str, torch.Tensor] | None = None,
) -> Eagle3Head:
    """Build the head and fill it from `tensors` (checkpoint names), or the head directory's
    files. Every required tensor must be there in its published shape; the error names what is
    missing or misshapen."""
    where = f"EAGLE-3 head {head.path or ''}".rstrip()
    if tensors is None:
        if head.path is None:
            raise ValueError(f"{where}: no tensors given and no directory to read them from.")
        tensors = dict(read_head_tensors(head.path))
    given = dict(tensors)
    missing = [k for k in REQUIRED_KEYS if k not in given]
    if head.draft_vocab_size == head.vocab_size and "d2t" in missing:
        missing.remove("d2t")  # a full-vocabulary head needs no mapping
    if missing:
        raise ValueError(f"{where} lacks tensors {', '.join(missing)}.")
    model = Eagle3Head(head, cfg, num_aux, dtype)
    has_embed = "embed_tokens.weight" in given
    if has_embed:
        model.embed_tokens = nn.Embedding(
            head.vocab_size, head.hidden_size, device="meta", dtype=dtype
        )
    model.to_empty(device=device)
    params = dict(model.named_parameters())
    q = head.num_heads * head.head_dim
    kv = head.num_kv_heads * head.head_dim
    rows = {
        "midlayer.self_attn.qkv_proj": [0, q, q + kv, q + 2 * kv],
        "midlayer.mlp.gate_up_proj": [0, head.intermediate_size, 2 * head.intermediate_size],
    }
    filled = dict.fromkeys(params, 0)
    for name, src in given.items():
        if name in ("d2t", "t2d"):
            continue
        module, _, kind = name.rpartition(".")
        if module in _FUSED:
            fused, shard = _FUSED[module]
            ours = f"{fused}.{kind}"
            bounds = rows[fused]
            dst = params[ours].data[bounds[shard] : bounds[shard + 1]] if ours in params else None
        else:
            ours = name
            dst = params[ours].data if ours in params else None
        if dst is None:
            raise ValueError(f"{where}: tensor {name!r} has no place in an EAGLE-3 head.")
        if tuple(src.shape) != tuple(dst.shape):
            raise ValueError(
                f"{where}: {name} has shape {list(src.shape)}, expected {list(dst.shape)}."
            )
        dst.copy_(src.to(dtype))
        filled[ours] += dst.numel()
    unfilled = [n for n, p in params.items() if filled[n] != p.numel()]
    if unfilled:
        raise ValueError(f"{where}: no values for {', '.join(unfilled)}.")
    ids = torch.arange(head.draft_vocab_size, dtype=torch.int64, device="cpu")
    if "d2t" in given:
        d2t = given["d2t"]
        if tuple(d2t.shape) != (head.draft_vocab_size,) or d2t.is_floating_point():
            raise ValueError(
                f"{where}: d2t must be integer offsets of shape [{head.draft_vocab_size}], "
                f"got {d2t.dtype} {list(d2t.shape)}."
            )
        ids = ids + d2t.to(torch.int64)
    if ids.min() < 0 or ids.max() >= head.vocab_size or len(set(ids.tolist())) != len(ids):
        raise ValueError(
            f"{where}: d2t maps draft ids outside [0, {head.vocab_size}) or two onto one id."
        )
    model.draft_to_target = ids.to(device)
    model.requires_grad_(False)
    return model


def head_state(model: Eagle3Head) -> dict[str, torch.Tensor]:
    """The head's tensors under the published names (q/k/v and gate/up split again), with d2t
    and t2d: what `save_head` writes and what vLLM's and SGLang's loaders read."""
    head = model.head_config
    q = head.num_heads * head.head_dim
    kv = head.num_kv_heads * head.head_dim
    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        tensor = param.detach().to("cpu").contiguous()
        if name.startswith("midlayer.self_attn.qkv_proj."):
            kind = name.rpartition(".")[2]
            parts = tensor.split([q, kv, kv])
            for proj, part in zip("qkv", parts, strict=True):
                out[f"midlayer.self_attn.{proj}_proj.{kind}"] = part.contiguous()
        elif name.startswith("midlayer.mlp.gate_up_proj."):
            gate, up = tensor.split([head.intermediate_size, head.intermediate_size])
            out["midlayer.mlp.gate_proj.weight"] = gate.contiguous()
            out["midlayer.mlp.up_proj.weight"] = up.contiguous()
        else:
            out[name] = tensor
    ids = model.draft_to_target.to("cpu")
    out["d2t"] = ids - torch.arange(len(ids), dtype=torch.int64, device="cpu")
    t2d = torch.zeros(head.vocab_size, dtype=torch.bool, device="cpu")
    t2d[ids] = True
    out["t2d"] = t2d
    return out


def save_head(model: Eagle3Head, path: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write the head directory: config.json and model.safetensors in the published format."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {
        k: (v.to(dtype) if v.is_floating_point() else v) for k, v in head_state(model).items()
    }
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    raw = dict(model.head_config.raw)
    raw["torch_dtype"] = str(dtype).removeprefix("torch.")
    (path / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    return path
