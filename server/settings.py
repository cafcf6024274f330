"""One settings model for the engine and the server, fed by a YAML file, the environment and flags.

Sources, lowest precedence first:
1. the YAML file (`--config`): its `engine:` section (the engine fields, as in `configs/*.yaml`)
   and its `server:` section (host, port, api_key, ...);
2. environment variables `SPECSERVE_<FIELD>` (e.g. `SPECSERVE_PORT=9000`,
   `SPECSERVE_API_KEY=...`); `speculative_config` is JSON, `cors_allow_origins` JSON or a
   comma-separated list;
3. command-line flags (`--max-num-seqs 8`; flags left out do not override anything).

`load_settings` merges them once into a frozen `Settings`; nothing writes to it later.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from engine.config import Dtype, EngineConfig, Quantization
from engine.spec.config import SpeculativeConfig

ENV_PREFIX = "SPECSERVE_"
LogLevel = Literal["critical", "error", "warning", "info", "debug"]


class Settings(BaseModel):
    """Everything `specserve serve` and `specserve generate` need, resolved once."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # --- engine ---
    model: str
    served_model_name: str | None = None  # None: the model argument
    dtype: Dtype = "auto"
    quantization: Quantization = "auto"
    device: str = "auto"
    max_num_seqs: Annotated[int, Field(ge=1)] = 16
    max_num_batched_tokens: Annotated[int, Field(ge=1)] = 256
    max_model_len: Annotated[int | None, Field(ge=2)] = None
    block_size: Annotated[int | None, Field(ge=1)] = None  # None: the attention backend's
    kv_cache_memory: Annotated[int | None, Field(ge=1)] = None
    num_kv_blocks: Annotated[int | None, Field(ge=1)] = None
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"
    speculative_config: dict[str, Any] | None = None
    seed: int = 0
    tokenizer: str | None = None
    gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)] = 0.9
    enforce_eager: bool = False

    # --- server ---
    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 8000  # 0: any free port
    api_key: str | None = None
    max_queue: Annotated[int, Field(ge=1)] = 256
    cors_allow_origins: list[str] = []
    shutdown_timeout: Annotated[float, Field(ge=0)] = 30.0
    max_body_bytes: Annotated[int, Field(ge=1)] = 4 << 20
    stream_one_token_per_chunk: bool = False
    speculation_stats: bool = False  # every choice reports speculative_decoding_stats
    log_level: LogLevel = "info"
    log_stats_interval: Annotated[float, Field(ge=0)] = 10.0  # seconds; 0: no stats log line

    @field_validator("speculative_config", mode="before")
    @classmethod
    def _json_object(cls, value: Any) -> Any:
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        return value

    @field_validator("speculative_config")
    @classmethod
    def _valid_speculation(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        # Checked with the rest of the settings, before the server binds: a bad one would
        # otherwise only fail once the model loads.
        if value is not None:
            SpeculativeConfig.from_dict(value)
        return value

    @field_validator("cors_allow_origins", mode="before")
    @classmethod
    def _origin_list(cls, value: Any) -> Any:
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                return json.loads(text)
            return [origin.strip() for origin in text.split(",") if origin.strip()]
        return value

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

    @property
    def model_name(self) -> str:
        """The name clients must send as `model`."""
        return self.served_model_name or self.model

    def engine_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of `EngineConfig` (those left unset are left out)."""
        names = {f.name for f in dataclasses.fields(EngineConfig)}
        values = self.model_dump(include=names)
        return {name: value for name, value in values.items() if value is not None}

    def engine_config(self) -> EngineConfig:
        return EngineConfig(**self.engine_kwargs())


FIELDS = tuple(Settings.model_fields)
_BOOL_FLAGS = {
    "enable_prefix_caching",
    "enforce_eager",
    "stream_one_token_per_chunk",
    "speculation_stats",
}
_FLAG_HELP = {
    "model": "bundled model name, Hugging Face directory or .gguf file",
    "served_model_name": "the name clients send as `model` (default: --model)",
    "api_key": f"require `Authorization: Bearer KEY` (or set {ENV_PREFIX}API_KEY)",
    "device": "auto (cuda when torch sees a GPU, else cpu), cpu, cuda or cuda:N",
    "quantization": "gguf (multiply by a GGUF model's own quantised blocks; CPU), none (dense "
    "weights in --dtype) or auto (gguf where it can run, else none)",
    "attention_backend": "auto (flash_attn on CUDA with flash-attn installed, cpu on a CPU "
    "where our kernels build, else torch), torch, cpu or flash_attn",
    "block_size": "KV cache page size in tokens (default: the attention backend's, "
    "16 for torch and cpu, 256 for flash_attn)",
    "gpu_memory_utilization": "CUDA: share of the GPU's memory the engine may use, in (0, 1]",
    "enforce_eager": "CUDA: run every step eagerly (no CUDA graphs)",
    "speculative_config": 'JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'',
    "cors_allow_origins": "comma-separated origins allowed by CORS ('*' for any)",
    "shutdown_timeout": "seconds in-flight requests may finish after SIGTERM",
    "max_queue": "requests that may wait for admission before new ones get 429",
    "max_body_bytes": "largest request body accepted (413 above)",
    "log_stats_interval": "seconds between engine stats log lines (0: none)",
    "stream_one_token_per_chunk": "send one SSE chunk per token, not one per engine step",
    "speculation_stats": "add speculative_decoding_stats to every choice (else per request)",
}


def add_settings_flags(parser: argparse.ArgumentParser, fields: tuple[str, ...] = FIELDS) -> None:
    """`--config` and one flag per settings field; every default is None (= not given)."""
    parser.add_argument("--config", help="YAML settings file with engine: and server: sections")
    for name in fields:
        flag = "--" + name.replace("_", "-")
        if name in _BOOL_FLAGS:
            action: Any = argparse.BooleanOptionalAction
            parser.add_argument(
                flag, dest=name, action=action, default=None, help=_FLAG_HELP.get(name)
            )
        else:
            parser.add_argument(flag, dest=name, default=None, help=_FLAG_HELP.get(name))


def load_settings(
    config_path: str | Path | None,
    flags: Mapping[str, Any] | argparse.Namespace | None = None,
    environ: Mapping[str, str] | None = None,
) -> Settings:
    """Merge YAML < environment < flags into `Settings`. Raises ValueError naming what is wrong."""
    merged: dict[str, Any] = {}
    if config_path:
        merged.update(_yaml_values(Path(config_path)))
    merged.update(_env_values(os.environ if environ is None else environ))
    if isinstance(flags, argparse.Namespace):
        flags = vars(flags)
    merged.update({k: v for k, v in (flags or {}).items() if k in FIELDS and v is not None})
    if "model" not in merged:
        raise ValueError(f"no model given (use --model, {ENV_PREFIX}MODEL or a --config file).")
    try:
        return Settings(**merged)
    except ValidationError as e:
        raise ValueError(_describe(e)) from None


def _yaml_values(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping with engine: and server: sections.")
    unknown = set(data) - {"engine", "server"}
    if unknown:
        raise ValueError(f"{path}: unknown sections {sorted(unknown)} (expected engine, server).")
    values: dict[str, Any] = {}
    for section in ("engine", "server"):
        values.update(data.get(section) or {})
    return values


def _env_values(environ: Mapping[str, str]) -> dict[str, Any]:
    # Only the settings' own names: other SPECSERVE_* variables (the model cache...) are not ours.
    values = {}
    for name in FIELDS:
        raw = environ.get(ENV_PREFIX + name.upper())
        if raw is not None and raw != "":
            values[name] = raw
    return values


def _describe(exc: ValidationError) -> str:
    parts = []
    for error in exc.errors(include_url=False):
        where = ".".join(str(p) for p in error.get("loc", ())) or "settings"
        parts.append(f"{where}: {error.get('msg')}")
    return "invalid settings: " + "; ".join(parts)
