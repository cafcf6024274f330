"""Tiny random models whose weights are GGUF blocks, built in code: a converted model directory
(config.json and float32 safetensors holding the blocks' exact dequantised values, as the
bundled-model conversion writes them) with the GGUF file beside it as model.gguf.

Blocks of the formats the gguf package can quantise (Q4_0, Q4_1, Q5_0, Q8_0) come from it; Q4_K
and Q6_K blocks are random integers and scales packed here, centred so the weights are roughly
N(0, 0.08) like the dense tiny models'.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize

from tests.conftest import build_tiny_model

Q = GGMLQuantizationType

# Our checkpoint names -> GGUF names.
_LAYER = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}

# Every format, and fused projections whose parts differ (q/k Q4_K with v Q6_K, gate Q4_0 with
# up Q5_0), as Q4_K_M files do.
MIXED_FORMATS = {
    "embed_tokens": Q.Q4_K,
    "lm_head": Q.Q6_K,
    "self_attn.q_proj": Q.Q4_K,
    "self_attn.k_proj": Q.Q4_K,
    "self_attn.v_proj": Q.Q6_K,
    "self_attn.o_proj": Q.Q8_0,
    "mlp.gate_proj": Q.Q4_0,
    "mlp.up_proj": Q.Q5_0,
    "mlp.down_proj": Q.Q4_1,
}


def random_blocks(rng: np.random.Generator, qtype: Q, rows: int, cols: int) -> np.ndarray:
    """uint8 [rows, bytes per row] of valid blocks of `qtype` for a [rows, cols] weight."""
    if qtype in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0):
        return quantize(rng.normal(0.0, 0.08, (rows, cols)).astype(np.float32), qtype)
    if qtype == Q.Q4_K:
        return _q4_k(rng, rows, cols // 256).reshape(rows, -1)
    if qtype == Q.Q6_K:
        return _q6_k(rng, rows, cols // 256).reshape(rows, -1)
    raise ValueError(f"no random blocks for {qtype.name}")


def _f16(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(*values.shape, 2)


def _q4_k(rng: np.random.Generator, rows: int, num_blocks: int) -> np.ndarray:
    shape = (rows, num_blocks)
    d = rng.uniform(2.5e-3, 4.5e-3, shape)
    scale = rng.integers(1, 9, (*shape, 8))
    minimum = np.round(scale * 7.5).astype(np.int64)  # offsets centre q * scale on 0
    packed = np.zeros((*shape, 12), dtype=np.uint8)
    packed[..., 0:4] = (scale[..., :4] & 63) | ((scale[..., 4:] >> 4) << 6)
    packed[..., 4:8] = (minimum[..., :4] & 63) | ((minimum[..., 4:] >> 4) << 6)
    packed[..., 8:12] = (scale[..., 4:] & 15) | ((minimum[..., 4:] & 15) << 4)
    qs = rng.integers(0, 256, (*shape, 128), dtype=np.uint8)
    return np.concatenate([_f16(d), _f16(d), packed, qs], axis=-1)


def _q6_k(rng: np.random.Generator, rows: int, num_blocks: int) -> np.ndarray:
    shape = (rows, num_blocks)
    ql = rng.integers(0, 256, (*shape, 128), dtype=np.uint8)
    qh = rng.integers(0, 256, (*shape, 64), dtype=np.uint8)
    scales = rng.integers(-128, 128, (*shape, 16)).astype(np.int8).view(np.uint8)
    d = rng.uniform(4e-5, 8e-5, shape)
    return np.concatenate([ql, qh, scales, _f16(d)], axis=-1)


def _llama_cpp_rows(rows: int, heads: int) -> np.ndarray:
    """llama.cpp's row order of a llama q/k projection: row i of its file is checkpoint row
    result[i] (the two rotary halves of each head interleaved)."""
    return np.arange(rows).reshape(heads, 2, rows // heads // 2).swapaxes(1, 2).reshape(rows)


def build_tiny_gguf_model(
    path: Path, arch: str, seed: int = 0, formats: dict[str, Q] | None = None, **overrides
) -> Path:
    """A tiny `arch` model at `path` whose weights named in `formats` (default MIXED_FORMATS) are
    GGUF blocks: model.gguf holds the blocks (q/k rows in llama.cpp's order for llama), the
    safetensors their dequantised values in float32. Sizes are multiples of 256 (K-quants)."""
    formats = dict(MIXED_FORMATS if formats is None else formats)
    sizes = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4)
    build_tiny_model(path, arch, seed=seed, **{**sizes, **overrides})
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path / "model.gguf"), "llama" if arch in ("llama", "mistral") else arch)
    for name, dense in sorted(tensors.items()):
        parts = name.split(".")
        if name == "model.embed_tokens.weight":
            key, gguf_name = "embed_tokens", "token_embd.weight"
        elif name == "lm_head.weight":
            key, gguf_name = "lm_head", "output.weight"
        elif len(parts) == 6 and ".".join(parts[3:5]) in _LAYER and parts[5] == "weight":
            key = ".".join(parts[3:5])
            gguf_name = f"blk.{parts[2]}.{_LAYER[key]}.weight"
        else:
            continue
        if key not in formats:
            continue
        rows, cols = dense.shape
        blocks = random_blocks(rng, formats[key], rows, cols)
        values = dequantize(blocks, formats[key]).reshape(rows, cols)
        tensors[name] = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
        stored = blocks
        if arch in ("llama", "mistral") and key in ("self_attn.q_proj", "self_attn.k_proj"):
            stored = blocks[_llama_cpp_rows(rows, heads if "q_proj" in key else kv_heads)]
        writer.add_tensor(gguf_name, np.ascontiguousarray(stored), raw_dtype=formats[key])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path
