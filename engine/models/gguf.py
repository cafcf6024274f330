"""GGUF block-quantised weights, served as the file stores them.

A model that comes from a GGUF file (a bundled model, or a `.gguf` a user passes) keeps that file
beside its converted Hugging Face directory, as `model.gguf`. With `quantization` "gguf" the
linear layers and the embedding table take their weights from it in the file's own blocks
(Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K: what Q4_K_M, Q5_0 and Q4_1 files hold) and multiply by them
with the CPU kernels of engine/kernels (cpu_quant.cpp), which compute exactly the values the gguf
package's dequantiser gives (Q6_K and Q5_0 blocks are re-laid out at load into one byte per
weight, the same values: `serving_layout`, and where the activations are int8, Q4_K blocks have
their weights reordered for that product: `int8_layout`); every other tensor (norms, biases) is
dense, from the converted checkpoint or the file (below). A tensor in a format the kernels do not read stays
dense, and so does every projection fused with it.

`read_quantized` maps the file's tensor names to the checkpoint's, so the loader places both
kinds of tensor by one table. Llama-architecture files store the q and k projections with their
rows permuted for llama.cpp's rotary layout; the rows are put back in the checkpoint's order here,
as transformers' converter does, and `check_against_checkpoint` proves the result against the
converted weights at load where the directory has them.

A directory converted from a GGUF file need not hold the dense checkpoint (engine.models.bundled
writes it only when a dense path first needs it). Then `read_dense` gives the loader the rest of
the model from the file itself: the norms, the biases and any weight in a format the kernels do
not read, dequantised by the gguf package and cast to the checkpoint's dtype as the conversion
would have stored them, so the served model is the same either way.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine.kernels import cpu_kernels, unavailable_reason
from engine.models.gguf_reader import GgufFile, open_gguf

logger = logging.getLogger(__name__)

GGUF_FILE_NAME = "model.gguf"

# GGML type id -> (name, weights per block, bytes per block): the formats the kernels read.
QUANT_FORMATS: Mapping[int, tuple[str, int, int]] = {
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    8: ("Q8_0", 32, 34),
    12: ("Q4_K", 256, 144),
    14: ("Q6_K", 256, 210),
}
# Our own layouts (not GGML types): Q6_K's values one byte each (see `serving_layout`), and Q4_K's
# blocks in the order the int8-activation product reads (see `int8_layout`).
Q6_K8 = 1014
Q4_KT = 1012
_LAYOUTS: Mapping[int, tuple[str, int, int]] = {
    **QUANT_FORMATS,
    Q6_K8: ("Q6_K8", 256, 274),
    Q4_KT: ("Q4_KT", 256, 144),
}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.weight$")
# The rest of the model: norms and biases, GGUF name -> checkpoint name.
_OTHER_GLOBAL_NAMES = {"output_norm.weight": "model.norm.weight"}
_OTHER_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    **{f"{gguf}.bias": f"{ours}.bias" for gguf, ours in _LAYER_NAMES.items()},
}
_OTHER_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+\.(?:weight|bias))$")


@dataclass(frozen=True)
class QuantTensor:
    """A [rows, columns] weight as GGUF blocks: `blocks` is uint8 [rows, bytes per row]."""

    blocks: torch.Tensor
    qtype: int  # a GGML type id of QUANT_FORMATS, Q6_K8 or Q4_KT
    columns: int
    origin: str = ""  # the file's format, where the blocks were re-laid out from it

    @property
    def format(self) -> str:
        """The file's format these values come from (Q6_K for Q6_K8 blocks)."""
        return self.origin or _LAYOUTS[self.qtype][0]

    @property
    def rows(self) -> int:
        return int(self.blocks.shape[0])

    def dequantize(self) -> torch.Tensor:
        """The weight in float32, exactly as the gguf package dequantises it."""
        kernels = cpu_kernels()
        assert kernels is not None, "quantised weights need the CPU kernels"
        return kernels.dequantize(self.blocks, self.qtype, self.columns)


def gguf_file(model_dir: Path) -> Path | None:
    """The GGUF file a converted model directory came from, or None (a plain checkpoint)."""
    path = model_dir / GGUF_FILE_NAME
    return path if path.is_file() else None


def checkpoint_name(gguf_name: str) -> str | None:
    """The Hugging Face checkpoint name of a GGUF weight, or None for one we never quantise."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_RE.match(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}.weight"
    return None


def any_checkpoint_name(gguf_name: str) -> str | None:
    """The Hugging Face checkpoint name of any GGUF tensor the model takes (the weights of
    `checkpoint_name`, the norms, the biases), or None for one it does not (rope_freqs)."""
    if name := checkpoint_name(gguf_name):
        return name
    if gguf_name in _OTHER_GLOBAL_NAMES:
        return _OTHER_GLOBAL_NAMES[gguf_name]
    match = _OTHER_LAYER_RE.match(gguf_name)
    if match and match.group(2) in _OTHER_LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_OTHER_LAYER_NAMES[match.group(2)]}"
    return None


def permutes_q_k(reader: GgufFile) -> bool:
    """Whether llama.cpp stored the file's q and k projections with their rows permuted: it does
    for the llama architecture (and transformers' converter undoes it for that one)."""
    return reader.metadata.get("general.architecture") == "llama"


def read_quantized(
    reader: GgufFile, num_heads: int, num_kv_heads: int, permute: bool
) -> dict[str, QuantTensor]:
    """The file's block-quantised weights in formats the kernels read, by checkpoint name, copied
    out of the file; `permute` undoes llama.cpp's row order of the q and k projections."""
    out: dict[str, QuantTensor] = {}
    for tensor in reader.tensors:
        name = checkpoint_name(tensor.name)
        qtype = int(tensor.tensor_type)
        if name is None or qtype not in QUANT_FORMATS or len(tensor.shape) != 2:
            continue
        columns, rows = (int(n) for n in tensor.shape)  # GGUF lists the fastest dimension first
        data = np.asarray(tensor.data).reshape(rows, -1)
        if permute and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = num_heads if name.endswith("q_proj.weight") else num_kv_heads
            data = data[_unpermuted_rows(rows, heads)]
        blocks = torch.tensor(data, dtype=torch.uint8, device="cpu")  # a copy: the file closes
        out[name] = serving_layout(QuantTensor(blocks, qtype, columns))
    return out


def serving_layout(tensor: QuantTensor) -> QuantTensor:
    """The same weights in the layout the kernels multiply by fastest. Q6_K (six bits split in
    two arrays) becomes Q6_K8, one int8 per weight beside the same scales (274 bytes per 256
    weights instead of 210), and Q5_0 becomes Q8_0 (34 bytes per 32 instead of 22): a widening
    load instead of five bit operations per weight. The values are unchanged
    (tests/unit/test_quant_kernels.py)."""
    kernels = cpu_kernels()
    assert kernels is not None, "quantised weights need the CPU kernels"
    if tensor.qtype == 14:
        blocks = kernels.repack_q6_k(tensor.blocks, tensor.columns)
        return QuantTensor(blocks, Q6_K8, tensor.columns, origin="Q6_K")
    if tensor.qtype == 6:
        blocks = kernels.repack_q5_0(tensor.blocks, tensor.columns)
        return QuantTensor(blocks, 8, tensor.columns, origin="Q5_0")
    return tensor


def int8_layout(tensor: QuantTensor) -> QuantTensor:
    """The same weights in the layout the int8-activation product reads (`gguf_activations:
    int8`): Q4_K becomes Q4_KT, the same 144 bytes a block with each block's 256 weights reordered
    (an 8 x 8 transpose of groups of four, engine/kernels/gguf_blocks.h) so that every 32 of them
    hold four of each sub-block, one sub-block per lane of the integer dot product; one
    multiply-add per 32 weights and activation row instead of two. Other layouts are returned as
    they are. Q4_KT has no float32-activation product; its values are unchanged
    (tests/unit/test_int8_kernels.py)."""
    if tensor.qtype != 12:
        return tensor
    kernels = cpu_kernels()
    assert kernels is not None, "quantised weights need the CPU kernels"
    blocks = kernels.repack_q4_k_t(tensor.blocks, tensor.columns)
    return QuantTensor(blocks, Q4_KT, tensor.columns, origin=tensor.origin or "Q4_K")


def read_dense(
    path: Path,
    wanted: Callable[[str], bool],
    num_heads: int,
    num_kv_heads: int,
    dtype: torch.dtype,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The file's tensors whose checkpoint names `wanted` accepts (not those served as blocks),
    by checkpoint name, in `dtype`: the values the dense conversion stores (transformers' GGUF
    loader dequantises with the same gguf package, undoes the same q/k row order for a llama
    file and casts to the checkpoint's dtype the same way)."""
    from gguf import GGMLQuantizationType, dequantize

    reader = open_gguf(path)
    permute = permutes_q_k(reader)
    for tensor in reader.tensors:
        name = any_checkpoint_name(tensor.name)
        if name is None or not wanted(name):
            continue
        # float32 [rows, columns] or [rows]
        values = dequantize(tensor.data, GGMLQuantizationType(tensor.tensor_type))
        if permute and name.rsplit(".", 2)[-2] in ("q_proj", "k_proj"):  # weight and bias
            heads = num_heads if ".q_proj." in name else num_kv_heads
            values = values[_unpermuted_rows(values.shape[0], heads)]
        values = np.ascontiguousarray(values, dtype=np.float32)
        yield name, torch.tensor(values, dtype=torch.float32, device="cpu").to(dtype)


def _unpermuted_rows(rows: int, heads: int) -> np.ndarray:
    """Row i of the checkpoint's projection is row result[i] of llama.cpp's: within each head,
    llama.cpp interleaves the two rotary halves, (a0, b0, a1, b1, ...)."""
    index = np.arange(rows).reshape(heads, rows // heads // 2, 2)
    return index.swapaxes(1, 2).reshape(rows)


def check_against_checkpoint(model_dir: Path, tensors: Mapping[str, QuantTensor]) -> bool:
    """Whether layer 0's quantised projections, dequantised and cast to the converted
    checkpoint's dtype, equal its tensors there (it was converted from the same file): proof
    that names and row order match. True where the directory holds no dense checkpoint (yet):
    then the architecture's order stands, as it does for transformers' converter."""
    from safetensors import safe_open

    names = [
        f"model.layers.0.{proj}.weight"
        for proj in ("self_attn.q_proj", "self_attn.k_proj", "mlp.down_proj")
    ]
    names = [name for name in names if name in tensors]
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in [n for n in names if n in f.keys()]:  # noqa: SIM118
                dense = f.get_tensor(name)
                if not torch.equal(tensors[name].dequantize().to(dense.dtype), dense):
                    return False
    return True


def load_quantized(
    model_dir: Path, num_heads: int, num_kv_heads: int, setting: str, device: torch.device
) -> dict[str, QuantTensor] | None:
    """The GGUF weights to serve for `quantization` setting "gguf" or "auto", or None for dense
    weights ("none"; "auto" without a GGUF file, off the CPU or without the CPU kernels). "gguf"
    where it cannot be served raises ValueError saying why."""
    if setting == "none":
        return None
    path = gguf_file(model_dir)
    problem = None
    if path is None:
        problem = f"{model_dir} has no {GGUF_FILE_NAME} (it was not converted from a GGUF file)"
    elif device.type != "cpu":
        problem = f"the GGUF kernels run on the CPU, and this model runs on {device}"
    elif cpu_kernels() is None:
        problem = f"the CPU kernels are unavailable: {unavailable_reason() or 'the build failed'}"
    if problem is not None:
        if setting == "gguf":
            raise ValueError(f"quantization gguf cannot be served: {problem}.")
        logger.info("serving dense weights: %s", problem)
        return None
    assert path is not None
    # The architecture says whether llama.cpp permuted the q/k rows; where the checkpoint
    # disagrees (an architecture stored under another's name), the other order is tried.
    reader = open_gguf(path)
    permute = permutes_q_k(reader)
    for order in (permute, not permute):
        tensors = read_quantized(reader, num_heads, num_kv_heads, order)
        if check_against_checkpoint(model_dir, tensors):
            break
    else:
        raise ValueError(
            f"{path}: its quantised weights do not match the converted checkpoint in "
            f"{model_dir}; delete that directory to convert the file again."
        )
    if not tensors:
        if setting == "gguf":
            raise ValueError(
                f"quantization gguf cannot be served: {path} has no weights in a format the "
                f"kernels read ({', '.join(name for name, _, _ in QUANT_FORMATS.values())})."
            )
        return None
    return tensors
