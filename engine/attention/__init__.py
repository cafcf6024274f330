"""Attention backends, chosen by name through a registry whose factories import lazily.

`torch` runs everywhere (the reference); `flash_attn` needs CUDA and the flash-attn package.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.attention.base import AttentionBackend, BatchLayout


def _make_torch() -> AttentionBackend:
    from engine.attention.torch_attn import TorchAttentionBackend

    return TorchAttentionBackend()


def _make_flash_attn() -> AttentionBackend:
    from engine.attention.flash_attn import FlashAttentionBackend

    return FlashAttentionBackend()


BACKENDS: dict[str, Callable[[], AttentionBackend]] = {
    "torch": _make_torch,
    "flash_attn": _make_flash_attn,
}


def flash_attn_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """'auto' picks flash_attn on CUDA when it is installed, torch otherwise."""
    if name == "auto":
        name = "flash_attn" if device.type == "cuda" and flash_attn_available() else "torch"
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {sorted(BACKENDS)}.")
    return BACKENDS[name]()


__all__ = ["AttentionBackend", "BatchLayout", "get_attention_backend", "BACKENDS"]
