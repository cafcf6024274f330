"""Dense weights into GGUF blocks (Q8_0, Q6_K), for a model the engine quantises itself (an EAGLE-3
head served on the CPU kernels: `draft_quantization`).
"""

from __future__ import annotations

import torch

from engine.models.gguf import QuantTensor


def quantize_q8_0(weight: torch.Tensor) -> QuantTensor:
    """A float weight [rows, columns] (columns a multiple of 32) as Q8_0 blocks, made as ggml's
    reference quantiser makes them: per 32 weights d = max|w| / 127 stored as float16, and the
    weights as round(w / d) in int8 (0 where d is 0)."""
    rows, columns = weight.shape
    if columns % 32:
        raise ValueError(f"Q8_0 needs a multiple of 32 columns, got {columns}.")
    w = weight.detach().to("cpu", torch.float32).reshape(rows, columns // 32, 32)
    d = w.abs().amax(dim=-1, keepdim=True) / 127  # [rows, blocks, 1]
    inverse = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(w * inverse).clamp(-127, 127).to(torch.int8)
    scales = d.to(torch.float16).view(torch.uint8)  # [rows, blocks, 2], little-endian float16
    blocks = torch.cat((scales, q.view(torch.uint8)), dim=-1).reshape(rows, columns // 32 * 34)
    return QuantTensor(blocks.contiguous(), 8, columns)


def quantize_q6_k(weight: torch.Tensor) -> QuantTensor:
    """A float weight [rows, columns] (columns a multiple of 256) as GGML Q6_K blocks (210 bytes
    per 256 weights: the low four bits of each 6-bit q in ql[128], the high two in qh[64], 16
    int8 sub-block scales, a float16 d; weight = d * scale * (q - 32)). Per 16 weights the step
    wanted is max|w| / 31 (so q - 32 stays in [-31, 31]); it is stored as ceil(step / d), with
    d = the largest step of the block / 126.5 (the ceiling stays within 127 after d's float16
    rounding), so the step used is at least the one wanted and at most d more, and
    q = round(w / (d * scale)) + 32. A plain quantiser (ggml's searches each scale): every
    weight within half its step."""
    rows, columns = weight.shape
    if columns % 256:
        raise ValueError(f"Q6_K needs a multiple of 256 columns, got {columns}.")
    nb = columns // 256
    w = weight.detach().to("cpu", torch.float32).reshape(rows, nb, 16, 16)
    group = w.abs().amax(dim=-1) / 31  # [rows, nb, 16]
    d = (group.amax(dim=-1, keepdim=True) / 126.5).to(torch.float16)  # [rows, nb, 1]
    df = d.float()
    scales = torch.where(df > 0, group / df, torch.zeros_like(group)).ceil().clamp(0, 127)
    step = (df * scales)[..., None]  # [rows, nb, 16, 1]
    q = torch.where(step > 0, w / step, torch.zeros_like(w)).round().clamp(-32, 31) + 32
    q = q.to(torch.uint8).reshape(rows, nb, 2, 128)  # halves of 128 weights
    low, high = q & 0xF, q >> 4
    ql = low[..., :64] | (low[..., 64:] << 4)  # [rows, nb, 2, 64]
    qh = high[..., :32] | (high[..., 32:64] << 2) | (high[..., 64:96] << 4) | (high[..., 96:] << 6)
    blocks = torch.cat(
        (
            ql.reshape(rows, nb, 128),
            qh.reshape(rows, nb, 64),
            scales.to(torch.int8).view(torch.uint8),
            d.view(torch.uint8),  # little-endian float16
        ),
        dim=-1,
    )
    return QuantTensor(blocks.reshape(rows, nb * 210).contiguous(), 14, columns)
