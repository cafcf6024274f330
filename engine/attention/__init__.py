"""Attention backends, chosen by name through a registry whose factories import lazily.

`torch` runs everywhere (the reference); `cpu` runs every step by our batch-invariant CPU
paged-attention kernel (it needs the CPU kernels built); `flash_attn` needs CUDA and the
flash-attn package; `triton` needs CUDA and Triton (what a CUDA node without flash-attn serves
with).
Each backend declares what it can run (`BackendSpec`): the engine configuration checks a
(backend, device, dtype, block size) combination against it once, when it is built, so an
impossible combination is a clear error at startup rather than a failure inside the first forward.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from engine.attention.base import AttentionBackend, BatchLayout

logger = logging.getLogger(__name__)


def _make_torch() -> AttentionBackend:
    from engine.attention.torch_attn import TorchAttentionBackend

    return TorchAttentionBackend()


def _make_cpu() -> AttentionBackend:
    from engine.attention.cpu_paged import CpuAttentionBackend

    return CpuAttentionBackend()


def _cpu_kernels_available() -> bool:
    from engine.kernels import cpu_kernels

    return cpu_kernels() is not None


def _make_flash_attn() -> AttentionBackend:
    from engine.attention.flash_attn import FlashAttentionBackend

    return FlashAttentionBackend()


def _cuda_with(module: str) -> bool:
    """CUDA is usable and `module` imports."""
    if not torch.cuda.is_available():
        return False
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def flash_attn_available() -> bool:
    """CUDA is usable and the flash-attn package imports."""
    return _cuda_with("flash_attn")


def _make_triton() -> AttentionBackend:
    from engine.attention.triton_attn import TritonAttentionBackend

    return TritonAttentionBackend()


def triton_available() -> bool:
    """CUDA is usable and Triton imports."""
    return _cuda_with("triton")


def _always() -> bool:
    return True


def _flash_attn_is_available() -> bool:
    # Looked up by name at call time, so tests can fake a CUDA node by patching
    # `engine.attention.flash_attn_available`.
    return flash_attn_available()


def _triton_is_available() -> bool:
    # By name at call time, as _flash_attn_is_available.
    return triton_available()


@dataclass(frozen=True)
class BackendSpec:
    """One attention backend: how to build it and which configurations it can run.

    `device_types` and `dtypes` are None where anything goes; `dtypes` lists the preferred dtype
    first (what `dtype: auto` falls back to when the checkpoint's dtype is refused). A block size
    must be a multiple of `block_size_multiple`; `default_block_size` is used when none is given.
    """

    name: str
    factory: Callable[[], AttentionBackend]
    device_types: tuple[str, ...] | None
    dtypes: tuple[str, ...] | None
    block_size_multiple: int
    default_block_size: int
    is_available: Callable[[], bool]
    unavailable_reason: str = ""

    def __post_init__(self) -> None:
        if self.default_block_size % self.block_size_multiple:
            raise ValueError(f"{self.name}: the default block size breaks its own multiple.")

    def supports_device(self, device_type: str) -> bool:
        return self.device_types is None or device_type in self.device_types

    def supports_dtype(self, dtype: torch.dtype | str) -> bool:
        return self.dtypes is None or dtype_name(dtype) in self.dtypes

    def supports_block_size(self, block_size: int) -> bool:
        return block_size % self.block_size_multiple == 0


BACKENDS: dict[str, BackendSpec] = {
    spec.name: spec
    for spec in (
        BackendSpec(
            name="torch",
            factory=_make_torch,
            device_types=None,
            dtypes=None,
            block_size_multiple=1,
            default_block_size=16,
            is_available=_always,
        ),
        BackendSpec(
            name="cpu",
            factory=_make_cpu,
            device_types=("cpu",),
            dtypes=("bfloat16", "float32"),
            block_size_multiple=1,
            default_block_size=16,
            is_available=_cpu_kernels_available,
            unavailable_reason="the CPU kernels are turned off or could not be built here "
            "(the start-up log says why)",
        ),
        BackendSpec(
            name="flash_attn",
            factory=_make_flash_attn,
            device_types=("cuda",),
            dtypes=("bfloat16", "float16"),
            # flash-attn 2 reads a paged KV cache only with pages of a multiple of 256 tokens.
            block_size_multiple=256,
            default_block_size=256,
            is_available=_flash_attn_is_available,
            unavailable_reason="CUDA is not usable or the flash-attn package is not installed "
            "(pip install 'specserve[gpu]')",
        ),
        BackendSpec(
            name="triton",
            factory=_make_triton,
            device_types=("cuda",),
            dtypes=("bfloat16", "float16", "float32"),
            # The kernel maps every key position to its slot, so any page size works; 16-token
            # pages are the CPU path's, and multiples of them keep block tables short.
            block_size_multiple=16,
            default_block_size=16,
            is_available=_triton_is_available,
            unavailable_reason="CUDA is not usable or Triton is not installed (pip install triton)",
        ),
    )
}
# What "auto" tries, best first: the first one available that accepts the configuration wins.
AUTO_ORDER = ("flash_attn", "triton", "cpu", "torch")


def dtype_name(dtype: torch.dtype | str) -> str:
    """'bfloat16' for torch.bfloat16 or 'bfloat16'."""
    return str(dtype).removeprefix("torch.")


def backend_spec(name: str) -> BackendSpec:
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {sorted(BACKENDS)}.")
    return BACKENDS[name]


def check_attention_backend(
    name: str,
    device_type: str,
    dtypes: Mapping[str, torch.dtype | str] | None = None,
    block_size: int | None = None,
) -> BackendSpec:
    """The backend's spec if it can run on `device_type` with every dtype of `dtypes` (setting
    name -> dtype, e.g. {"dtype": "float32"}) and pages of `block_size` tokens (None: not
    checked); otherwise a ValueError naming what is wrong and what would work."""
    spec = backend_spec(name)
    if not spec.supports_device(device_type):
        devices = " or ".join(spec.device_types or ())
        raise ValueError(
            f"attention backend {name} runs on {devices} only, not {device_type}; "
            f"use attention_backend: torch (or auto) on {device_type}."
        )
    if not spec.is_available():
        raise ValueError(
            f"attention backend {name} is not available here: {spec.unavailable_reason}; "
            "use attention_backend: torch (or auto)."
        )
    for setting, dtype in (dtypes or {}).items():
        if not spec.supports_dtype(dtype):
            raise ValueError(
                f"attention backend {name} supports dtype {' or '.join(spec.dtypes or ())}, "
                f"not {setting}: {dtype_name(dtype)}; set {setting}: "
                f"{(spec.dtypes or ('auto',))[0]}, or use attention_backend: torch."
            )
    if block_size is not None and not spec.supports_block_size(block_size):
        raise ValueError(
            f"attention backend {name} needs block_size to be a multiple of "
            f"{spec.block_size_multiple}, got {block_size}; use block_size: "
            f"{spec.default_block_size} (or leave it out for the backend's default), "
            "or attention_backend: torch."
        )
    return spec


def resolve_attention_backend(
    name: str,
    device_type: str,
    dtypes: Mapping[str, torch.dtype | str] | None = None,
    block_size: int | None = None,
) -> BackendSpec:
    """The spec of `name`, checked (see `check_attention_backend`); "auto" is the first of
    AUTO_ORDER that accepts the whole combination (flash_attn on a CUDA node with flash-attn
    installed, triton on one without, cpu on a CPU where our kernels build, torch otherwise)."""
    if name != "auto":
        return check_attention_backend(name, device_type, dtypes, block_size)
    for candidate in AUTO_ORDER:
        try:
            return check_attention_backend(candidate, device_type, dtypes, block_size)
        except ValueError as e:
            spec = BACKENDS[candidate]
            if spec.supports_device(device_type) and spec.is_available():
                # The node could run it: an explicit dtype or block size ruled it out.
                logger.warning("attention_backend auto skips %s: %s", candidate, e)
    raise AssertionError("the torch backend accepts every configuration")


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """Build the backend `name`; 'auto' picks as `resolve_attention_backend` does. Configuration
    checks belong to `EngineConfig`, which hands a concrete name here."""
    if name == "auto":
        return resolve_attention_backend(name, device.type).factory()
    return backend_spec(name).factory()


__all__ = [
    "AttentionBackend",
    "BACKENDS",
    "BackendSpec",
    "BatchLayout",
    "check_attention_backend",
    "flash_attn_available",
    "get_attention_backend",
    "resolve_attention_backend",
    "triton_available",
]
