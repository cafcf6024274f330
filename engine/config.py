"""Engine configuration: one frozen object, resolved once.

`EngineConfig` holds what the user asked for; `ModelConfig` is what the checkpoint says about the
architecture. Nothing writes to either after construction.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

import torch

from engine.attention import backend_spec, resolve_attention_backend
from engine.spec.config import SpeculativeConfig
from engine.tokenizer import config_eos_token_ids

Dtype = Literal["auto", "bfloat16", "float16", "float32"]
Quantization = Literal["auto", "none", "gguf"]
QUANTIZATIONS: tuple[str, ...] = get_args(Quantization)

_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}

# Architectures our Llama-family implementation serves, mapped to the knobs that tell them apart.
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


@dataclass(frozen=True)
class EngineConfig:
    """What the user asked for, with the hardware choices resolved once, when it is built.

    `device`, `attention_backend` and `block_size` are resolved together in `__post_init__`:
    device "auto" is "cuda" when torch sees a GPU, else "cpu"; attention_backend "auto" is
    flash_attn on CUDA with flash-attn installed (when it accepts the dtype and block size asked
    for), else torch; block_size None is the backend's default (16 for torch, 256 for
    flash_attn). Afterwards all three are concrete, and a combination the backend cannot run
    (flash_attn on CPU, float32, pages of 16 tokens) has already raised a ValueError saying what
    would work. `dtype` "auto" depends on the checkpoint: `torch_dtype` resolves it to a dtype the
    backend accepts. Sizes left as None are derived from the model and the device.
    """

    model: str
    dtype: Dtype = "auto"
    # "gguf": the linears of a model converted from a GGUF file multiply by the file's own blocks
    # (CPU; engine.models.gguf); "none": dense weights in `dtype`; "auto": gguf where it can be
    # served (a GGUF model on the CPU with the CPU kernels), else none. Activations and the KV
    # cache are in `dtype` either way.
    quantization: Quantization = "auto"
    device: str = "auto"
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 256
    max_model_len: int | None = None
    # None (the default): the attention backend's default. __post_init__ always sets it, so every
    # reader sees an int, which is what the annotation states.
    block_size: int = None  # type: ignore[assignment]
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"
    speculative_config: Mapping[str, Any] | SpeculativeConfig | None = None
    seed: int = 0
    tokenizer: str | None = None
    # CUDA: the share of the device's memory the engine may use (weights, activations and the KV
    # of every model); the KV budget is what is left of it once every weight is loaded.
    gpu_memory_utilization: float = 0.9
    # CUDA: run every step eagerly instead of replaying captured CUDA graphs for small steps.
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        spec = self.speculative_config
        if spec is not None and not isinstance(spec, SpeculativeConfig):
            object.__setattr__(self, "speculative_config", SpeculativeConfig.from_dict(spec))
        if self.dtype not in ("auto", *_DTYPES):
            raise ValueError(
                f"dtype must be one of auto, bfloat16, float16, float32; got {self.dtype!r}."
            )
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATIONS)}; "
                f"got {self.quantization!r}."
            )
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}.")
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {self.block_size}.")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be at least 1, got {self.num_kv_blocks}.")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}.")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}."
            )
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be true or false, got {self.enforce_eager!r}.")
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
        backend = resolve_attention_backend(
            self.attention_backend, device_type, self._explicit_dtypes(), self.block_size
        )
        object.__setattr__(self, "device", device)
        object.__setattr__(self, "attention_backend", backend.name)
        if self.block_size is None:
            object.__setattr__(self, "block_size", backend.default_block_size)

    def _explicit_dtypes(self) -> dict[str, str]:
        """The dtypes the models will run in that are known now, by setting: the target's unless
        "auto" (see `torch_dtype`), and the draft model's when speculative_config names one."""
        dtypes = {} if self.dtype == "auto" else {"dtype": str(self.dtype)}
        spec = self.speculative_config
        draft_dtype = spec.draft_dtype if isinstance(spec, SpeculativeConfig) else None
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


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of a Llama-family checkpoint, read from its config.json."""

    path: Path
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    torch_dtype: str
    eos_token_ids: tuple[int, ...]
    hf_config: Any = field(repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads.")

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V cache one token takes across all layers, per byte of dtype."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    @classmethod
    def from_path(cls, path: str | Path) -> ModelConfig:
        from transformers import AutoConfig

        path = Path(path)
        hf = AutoConfig.from_pretrained(path, local_files_only=True)
        archs = getattr(hf, "architectures", None) or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or hf.model_type!r}; "
                f"specserve serves {', '.join(SUPPORTED_ARCHITECTURES)}."
            )
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        raw = json.loads((path / "config.json").read_text())
        return cls(
            path=path,
            architecture=arch,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=hf.num_attention_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            # Qwen2 has q/k/v biases without saying so in its config.
            attention_bias=bool(getattr(hf, "attention_bias", arch == "Qwen2ForCausalLM")),
            qk_norm=arch == "Qwen3ForCausalLM",
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"),
            eos_token_ids=config_eos_token_ids(path),
            hf_config=hf,
        )
