"""Engine configuration: one frozen object, resolved once.

`EngineConfig` holds what the user asked for (`engine.models.config.ModelConfig` is what the
checkpoint says about the architecture). Nothing writes to it after construction.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass
from typing import Annotated, Any, Literal, get_args, get_origin, get_type_hints

import torch
from pydantic import Field

import engine.attention
from engine.attention import backend_spec, resolve_attention_backend
from engine.models.config import ModelConfig
from engine.speculative_config import SpeculativeConfig

Dtype = Literal["auto", "bfloat16", "float16", "float32"]
Quantization = Literal["auto", "none", "gguf"]
GgufActivations = Literal["float32", "int8"]

_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}


@dataclass(frozen=True)
class EngineConfig:
    """What the user asked for, with the hardware choices resolved once, when it is built.

    Every field is declared once, here: type, default, bounds and description (pydantic `Field`
    metadata, which the dataclass itself ignores). `__post_init__` enforces the bounds and choices
    for `LLM(**kwargs)`; the server derives its engine settings, flags and `--help` from the same
    declarations, so the two cannot drift apart.

    `device`, `attention_backend` and `block_size` are resolved together in `__post_init__`:
    device "auto" is "cuda" when torch sees a GPU, else "cpu"; attention_backend "auto" is
    flash_attn on CUDA with flash-attn installed (when it accepts the dtype and block size asked
    for), else torch; block_size None is the backend's default (16 for torch, 256 for
    flash_attn). Afterwards all three are concrete, and a combination the backend cannot run
    (flash_attn on CPU, float32, pages of 16 tokens) has already raised a ValueError saying what
    would work. `dtype` "auto" depends on the checkpoint: `torch_dtype` resolves it to a dtype the
    backend accepts. Sizes left as None are derived from the model and the device.
    """

    model: Annotated[
        str, Field(description="bundled model name, Hugging Face directory or .gguf file")
    ]
    dtype: Annotated[
        Dtype,
        Field(
            description="dense weights, activations and the KV cache; auto: the checkpoint's "
            "(bfloat16 for float16 on the CPU, float32 where GGUF blocks are served)"
        ),
    ] = "auto"
    quantization: Annotated[
        Quantization,
        Field(
            description="gguf (multiply by a GGUF model's own quantised blocks; CPU), none "
            "(dense weights in --dtype) or auto (gguf where it can run, else none)"
        ),
    ] = "auto"
    gguf_activations: Annotated[
        GgufActivations,
        Field(
            description="what GGUF blocks multiply: float32 activations (the dequantised "
            "model's products exactly) or int8 (quantised per 256 columns as llama.cpp does, "
            "integer dot products for Q4_K/Q6_K: several rows a step cost far less)"
        ),
    ] = "float32"
    device: Annotated[
        str, Field(description="auto (cuda when torch sees a GPU, else cpu), cpu, cuda or cuda:N")
    ] = "auto"
    max_num_seqs: Annotated[int, Field(ge=1, description="most requests in one step")] = 16
    max_num_batched_tokens: Annotated[
        int,
        Field(ge=1, description="most tokens computed in one step (longer prompts go in chunks)"),
    ] = 256
    max_model_len: Annotated[
        int | None,
        Field(
            ge=2,
            description="longest prompt + output in tokens (default: the model's, no more than "
            "the KV cache holds)",
        ),
    ] = None
    # None: the attention backend's default. __post_init__ always sets it, so every reader sees
    # an int, which is what the annotation states.
    block_size: Annotated[
        int,
        Field(
            ge=1,
            description="KV cache page size in tokens (default: the attention backend's, 16 for "
            "torch and cpu, 256 for flash_attn)",
        ),
    ] = None  # type: ignore[assignment]
    num_kv_blocks: Annotated[
        int | None,
        Field(
            ge=1,
            description="KV cache blocks, for the target and the draft model alike (default: "
            "what the memory budget holds)",
        ),
    ] = None
    kv_cache_memory: Annotated[
        int | None,
        Field(
            ge=1,
            description="bytes the KV cache of every model may take together (default: CUDA: "
            "what gpu_memory_utilization leaves; CPU: 2 GiB)",
        ),
    ] = None
    enable_prefix_caching: Annotated[
        bool, Field(description="reuse the cached KV of a prompt's known prefix")
    ] = True
    attention_backend: Annotated[
        str,
        Field(
            description="auto (flash_attn on CUDA with flash-attn installed, cpu on a CPU where "
            "our kernels build, else torch), torch, cpu or flash_attn"
        ),
    ] = "auto"
    # Parsed at the edges (`LLM(speculative_config={...})`, the server's settings: a mapping, JSON
    # in a flag or variable), so the engine only ever sees a SpeculativeConfig or None.
    speculative_config: Annotated[
        SpeculativeConfig | None,
        Field(
            description="speculative decoding, a mapping (JSON in a flag or variable), e.g. "
            '\'{"method": "ngram", "num_speculative_tokens": 4}\''
        ),
    ] = None
    seed: Annotated[
        int, Field(description="the engine's seed, from which requests without one draw theirs")
    ] = 0
    tokenizer: Annotated[
        str | None, Field(description="tokenizer directory (default: the model's)")
    ] = None
    # The KV budget is what is left of this share once every model's weights are loaded.
    gpu_memory_utilization: Annotated[
        float,
        Field(
            gt=0,
            le=1,
            description="CUDA: share of the GPU's memory the engine may use (weights, "
            "activations and the KV of every model)",
        ),
    ] = 0.9
    enforce_eager: Annotated[
        bool, Field(description="CUDA: run every step eagerly (no CUDA graphs)")
    ] = False
    # None: on where it can run. __post_init__ always sets a bool.
    fused_layers: Annotated[
        bool,
        Field(
            description="CUDA: a decoder layer's residual adds, norms, RoPE with the K/V write "
            "and activation in fused Triton kernels (9 launches a layer with Triton attention; "
            "false: the torch formulation's 30-odd). Default: on where Triton is installed"
        ),
    ] = None  # type: ignore[assignment]
    # None: on where the host can run ahead of the device. __post_init__ always sets a bool.
    overlap_scheduling: Annotated[
        bool,
        Field(
            description="schedule and build step t+1 while the device runs step t, and read "
            "step t's tokens back after t+1 is launched (steps that draft nothing, with no "
            "grammar or penalties). Default: on CUDA; on the CPU the host is the device, so "
            "there is nothing to overlap (true still runs the overlapped path)"
        ),
    ] = None  # type: ignore[assignment]
    batch_invariant: Annotated[
        bool,
        Field(
            description="a request's logits never depend on what else shares its step (greedy "
            "answers equal to the request asked alone). CPU: what our kernels do anyway, "
            "checked at start; CUDA: Triton products, norms and attention with fixed "
            "reduction orders, slower than cuBLAS and flash-attn"
        ),
    ] = False

    def __post_init__(self) -> None:
        spec = self.speculative_config
        if spec is not None and not isinstance(spec, SpeculativeConfig):
            raise TypeError(
                f"speculative_config must be a SpeculativeConfig or None, got "
                f"{type(spec).__name__}: LLM(...) and the server's settings take a mapping and "
                "parse it (SpeculativeConfig.from_dict)."
            )
        for name, declared in _declarations().items():
            _check_declared(name, declared, getattr(self, name))
        self._resolve_hardware()

    def _resolve_hardware(self) -> None:
        """Make device, attention_backend and block_size concrete, checked against each other."""
        device = self.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            device_type = torch.device(device).type
        except RuntimeError:
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N; got {device!r}.") from None
        if self.quantization == "gguf" and device_type != "cpu":
            raise ValueError(
                f"quantization gguf runs on the CPU only (device is {device}); use "
                "quantization none or auto on a GPU."
            )
        attention = self.attention_backend
        if self.batch_invariant:
            attention = _invariant_attention(attention, device_type)
        backend = resolve_attention_backend(
            attention, device_type, self._explicit_dtypes(), self.block_size
        )
        object.__setattr__(self, "device", device)
        object.__setattr__(self, "attention_backend", backend.name)
        object.__setattr__(self, "fused_layers", _fused_layers(self.fused_layers, device_type))
        if self.overlap_scheduling is None:
            object.__setattr__(self, "overlap_scheduling", device_type == "cuda")
        if self.block_size is None:
            object.__setattr__(self, "block_size", backend.default_block_size)

    def _explicit_dtypes(self) -> dict[str, str]:
        """The dtypes the models will run in that are known now, by setting: the target's unless
        "auto" (see `torch_dtype`), and the draft model's when speculative_config names one."""
        dtypes = {} if self.dtype == "auto" else {"dtype": str(self.dtype)}
        spec = self.speculative_config
        draft_dtype = spec.draft_dtype if spec is not None else None
        if draft_dtype is not None:
            if draft_dtype not in _DTYPES:
                raise ValueError(
                    "speculative_config.draft_dtype must be one of bfloat16, float16, float32; "
                    f"got {draft_dtype!r}."
                )
            dtypes["speculative_config.draft_dtype"] = draft_dtype
        return dtypes

    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    def torch_dtype(self, model_config: ModelConfig, quantized: bool = False) -> torch.dtype:
        """'auto' takes the checkpoint's dtype, except float16 on CPU, which is slow there, and a
        dtype the attention backend refuses, which becomes the backend's preferred one (a float32
        checkpoint on flash_attn runs in bfloat16). Where GGUF blocks are served (`quantized`)
        it is float32: the CPU kernels multiply them by float32 activations, so then no layer
        converts on the way in and out."""
        if self.dtype != "auto":
            return _DTYPES[self.dtype]
        dtype = (
            torch.float32 if quantized else _DTYPES.get(model_config.torch_dtype, torch.bfloat16)
        )
        if dtype == torch.float16 and self.torch_device().type == "cpu":
            dtype = torch.bfloat16
        backend = backend_spec(self.attention_backend)
        if not backend.supports_dtype(dtype):
            assert backend.dtypes, "a backend that refuses a dtype lists the ones it accepts"
            dtype = _DTYPES[backend.dtypes[0]]
        return dtype


def _fused_layers(asked: bool | None, device_type: str) -> bool:
    """Whether the layers run the fused Triton kernels: asked for, or (None) wherever they can,
    which is CUDA with Triton installed."""
    has_triton = engine.attention.triton_available()
    if asked is None:
        return device_type == "cuda" and has_triton
    if asked and device_type != "cuda":
        raise ValueError(f"fused_layers runs on cuda (Triton kernels), not {device_type}.")
    if asked and not has_triton:
        raise ValueError("fused_layers needs Triton (pip install triton).")
    return asked


# The attention backend that batch_invariant takes on each device: the one whose sums over keys
# run in the same order for a query whatever its step holds.
_INVARIANT_ATTENTION = {"cpu": "cpu", "cuda": "triton"}


def _invariant_attention(asked: str, device_type: str) -> str:
    """The attention backend of the batch-invariant mode on `device_type`, or a ValueError
    saying why the one asked for cannot be it. The backend's own availability (our CPU kernels
    built, Triton installed) is then checked by the registry like any backend's."""
    backend = _INVARIANT_ATTENTION.get(device_type)
    if backend is None:
        raise ValueError(f"batch_invariant runs on cpu or cuda, not {device_type}.")
    if asked not in ("auto", backend):
        raise ValueError(
            f"batch_invariant on {device_type} needs attention_backend {backend} (or auto); "
            f"{asked} sums a query's keys in an order set by the whole step's shape."
        )
    return backend


_COMPARISONS = {"ge": operator.ge, "gt": operator.gt, "le": operator.le, "lt": operator.lt}


@functools.cache
def _declarations() -> dict[str, Any]:
    """EngineConfig's annotations with their `Field` metadata (resolved once: they are strings)."""
    return get_type_hints(EngineConfig, include_extras=True)


def _check_declared(name: str, declared: Any, value: Any) -> None:
    """Raise a ValueError naming `name` where `value` breaks what its declaration states: a
    Literal's choices, a bool, the Field's bounds. None is the "not set" of every optional."""
    if value is None:
        return
    kind, *infos = get_args(declared)
    if get_origin(kind) is Literal and value not in get_args(kind):
        raise ValueError(f"{name} must be one of {', '.join(get_args(kind))}; got {value!r}.")
    if kind is bool and not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}.")
    bounds = {
        key: getattr(constraint, key)
        for info in infos
        for constraint in info.metadata
        for key in _COMPARISONS
        if hasattr(constraint, key)
    }
    if not all(_COMPARISONS[key](value, bound) for key, bound in bounds.items()):
        raise ValueError(f"{name} must be {_bounds_text(bounds)}, got {value}.")


def _bounds_text(bounds: dict[str, Any]) -> str:
    if bounds.keys() == {"ge"}:
        return f"at least {bounds['ge']}"
    low = f"[{bounds['ge']}" if "ge" in bounds else f"({bounds.get('gt', '-inf')}"
    high = f"{bounds['le']}]" if "le" in bounds else f"{bounds.get('lt', 'inf')})"
    return f"in {low}, {high}"
