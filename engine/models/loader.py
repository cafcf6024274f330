"""Build a model and fill it from a Hugging Face checkpoint directory (safetensors, sharded or not).

The model is built on the meta device, materialised empty on the target device, and every
parameter is then copied from the checkpoint exactly once; a parameter the checkpoint does not
provide is an error, never a silently random weight. With GGUF-quantised weights
(engine.models.gguf) the linears and the embedding they cover are built as `QuantLinear` /
`QuantEmbedding` before materialising, so their dense weights are never allocated, and take the
file's blocks; the checkpoint fills the rest.

A directory converted from a GGUF file may hold no dense checkpoint (engine.models.bundled
writes none until a dense path needs it): serving the file's blocks, the rest then comes from the
file itself (`read_dense`); serving dense weights, the checkpoint is made here, on first use.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator, Mapping

import torch
from safetensors import safe_open
from torch import nn

from engine.models.bundled import ensure_dense_checkpoint
from engine.models.config import ModelConfig
from engine.models.gguf import QuantTensor, gguf_file, int8_layout, read_dense
from engine.models.linears import QuantEmbedding, QuantLinear
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


def _checkpoint_tensors(
    cfg: ModelConfig, wanted: Callable[[str], bool], from_gguf: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors that `wanted` accepts, by name. From the directory's safetensors;
    where it has none but was converted from a GGUF file, from that file when its blocks serve
    (`from_gguf`), else from the dense checkpoint converted now (once, minutes)."""
    files = sorted(cfg.path.glob("*.safetensors"))
    source = gguf_file(cfg.path)
    if not files and source is not None and from_gguf:
        dtype = getattr(torch, cfg.torch_dtype, None)
        dtype = dtype if isinstance(dtype, torch.dtype) else torch.bfloat16
        yield from read_dense(source, wanted, cfg.num_heads, cfg.num_kv_heads, dtype)
        return
    if not files and source is not None:
        ensure_dense_checkpoint(cfg.path)
        files = sorted(cfg.path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {cfg.path}.")
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if wanted(name):
                    yield name, f.get_tensor(name)


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


def _quantized_modules(
    cfg: ModelConfig, quantized: Mapping[str, QuantTensor]
) -> dict[str, list[tuple[int, str]]]:
    """Our module name -> its weight's parts as (first row, checkpoint name), for every linear or
    embedding whose whole weight the quantised tensors provide (a fused projection with one
    dense part stays dense)."""
    parts: dict[str, list[tuple[int, str]]] = {}
    for name in quantized:
        target = _target(cfg, name)
        if target is None:
            continue
        ours, rows = target
        parts.setdefault(ours.removesuffix(".weight"), []).append((rows[0] if rows else 0, name))
    return {
        module: sorted(found)
        for module, found in parts.items()
        if sum(quantized[name].rows for _, name in found) == _weight_rows(cfg, module)
    }


def _weight_rows(cfg: ModelConfig, module: str) -> int:
    if module in ("embed_tokens", "lm_head"):
        return cfg.vocab_size
    if module.endswith("qkv_proj"):
        return (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    if module.endswith("gate_up_proj"):
        return 2 * cfg.intermediate_size
    return cfg.hidden_size  # o_proj, down_proj


def _install_quantized(
    model: LlamaForCausalLM,
    modules: Mapping[str, list[tuple[int, str]]],
    dtype: torch.dtype,
) -> None:
    """Swap each covered module (still on the meta device) for its quantised form."""
    for name in modules:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, attr)
        if isinstance(old, nn.Embedding):
            setattr(parent, attr, QuantEmbedding(old.num_embeddings, old.embedding_dim, dtype))
        else:
            bias = old.bias is not None
            setattr(parent, attr, QuantLinear(old.in_features, old.out_features, bias, dtype))


def load_model(
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    quantized: Mapping[str, QuantTensor] | None = None,
    int8_activations: bool = False,
) -> LlamaForCausalLM:
    """Build `LlamaForCausalLM` for cfg and load its weights from cfg.path; the linears and the
    embedding that `quantized` (checkpoint name -> GGUF blocks) covers whole take those instead,
    multiplying int8-quantised activations where `int8_activations` and the format allows."""
    model = LlamaForCausalLM(cfg, dtype)
    quantized = quantized or {}
    modules = _quantized_modules(cfg, quantized)
    if modules and device.type != "cpu":
        raise ValueError(f"GGUF-quantised weights run on the CPU only, not on {device}.")
    _install_quantized(model, modules, dtype)
    model.to_empty(device=device)
    layout = int8_layout if int8_activations else lambda tensor: tensor
    for name, parts in modules.items():
        module = model.get_submodule(name)
        if isinstance(module, QuantEmbedding):
            module.set_weight(layout(quantized[parts[0][1]]))
        else:
            assert isinstance(module, QuantLinear)
            module.set_weight([layout(quantized[checkpoint]) for _, checkpoint in parts])
        module.int8_activations = int8_activations
    used = {checkpoint for parts in modules.values() for _, checkpoint in parts}
    params = dict(model.named_parameters())
    filled: dict[str, int] = {name: 0 for name in params}

    def wanted(name: str) -> bool:
        return name not in used and _target(cfg, name) is not None

    for name, src in _checkpoint_tensors(cfg, wanted, from_gguf=bool(quantized)):
        ours, rows = _target(cfg, name) or (name, None)
        if ours not in params:
            raise KeyError(f"checkpoint tensor {name!r} has no place in the model ({ours}).")
        param = params[ours]
        dst = param.data if rows is None else param.data[rows[0] : rows[1]]
        if src.shape != dst.shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(src.shape)} != {tuple(dst.shape)}.")
        dst.copy_(src.to(dtype))
        filled[ours] += src.shape[0] if rows is not None else dst.shape[0]
    missing = [n for n, p in params.items() if filled[n] != p.shape[0]]
    if missing:
        raise ValueError(f"checkpoint {cfg.path} does not provide: {', '.join(missing[:8])}.")
    model.eval()
    weights = str(dtype)
    if used:
        weights = f"{quantization_of(model)} blocks for {len(used)} tensors, {dtype} for the rest"
    logger.info(
        "loaded %s (%s, %d layers) with %s on %s",
        cfg.path.name,
        cfg.architecture,
        cfg.num_layers,
        weights,
        device,
    )
    return model


def quantization_of(model: nn.Module) -> str:
    """'gguf (Q4_K + Q6_K)' when some weights are GGUF blocks, else 'none'."""
    formats: set[str] = set()
    for module in model.modules():
        if isinstance(module, QuantLinear):
            formats.update(part.format for part in module.parts)
        elif isinstance(module, QuantEmbedding):
            formats.add(module.quant_weight.format)
    return f"gguf ({' + '.join(sorted(formats))})" if formats else "none"
