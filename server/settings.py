"""One settings model for the engine and the server, fed by a YAML file, the environment and flags.

Sources, lowest precedence first:
1. the YAML file (`--config`): its `engine:` section (the engine fields, as in `configs/*.yaml`)
   and its `server:` section (host, port, api_key, ...);
2. environment variables `SPECSERVE_<FIELD>` (e.g. `SPECSERVE_PORT=9000`,
   `SPECSERVE_API_KEY=...`); `speculative_config` is JSON, `cors_allow_origins` JSON or a
   comma-separated list;
3. command-line flags (`--max-num-seqs 8`; flags left out do not override anything).

`load_settings` merges them once into a frozen `Settings`; nothing writes to it later. The engine
fields are `EngineConfig`'s own declarations (type, default, bounds, description), and every flag
and its `--help` text comes from a field's declaration.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin, get_type_hints

import yaml
from pydantic import ConfigDict, Field, ValidationError, create_model, field_validator
from pydantic.fields import FieldInfo

from engine.config import EngineConfig
from engine.speculative_config import SpeculativeConfig
from server.request_limits import CONTEXTS_PER_REQUEST, DEFAULT_LIMITS, RequestLimits
from server.tool_parsers import choices as tool_parser_choices
from server.tool_parsers import names as tool_parser_names

ENV_PREFIX = "SPECSERVE_"
LogLevel = Literal["critical", "error", "warning", "info", "debug"]
ENGINE_FIELDS = tuple(f.name for f in dataclasses.fields(EngineConfig))


def _engine_fields() -> dict[str, Any]:
    """EngineConfig's fields as pydantic fields: its declarations (type, default, bounds,
    description) are the engine settings', so neither can drift from the other. A None default
    means "not set", so None is also a value a setting may take (block_size: the backend's)."""
    declared = get_type_hints(EngineConfig, include_extras=True)
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(EngineConfig):
        kind, *infos = get_args(declared[f.name])
        if f.name == "speculative_config":
            kind = Mapping[str, Any]  # the edge: a mapping here, parsed by engine_kwargs
        if f.default is None:
            kind = kind | None
        default = ... if f.default is dataclasses.MISSING else f.default
        fields[f.name] = (Annotated[(kind, *infos)], default)
    return fields


_EngineSettings = create_model(
    "_EngineSettings",
    __config__=ConfigDict(frozen=True, extra="forbid"),
    **_engine_fields(),
)


class Settings(_EngineSettings):  # type: ignore[misc,valid-type]
    """Everything `specserve serve` and `specserve generate` need, resolved once: the engine's
    fields (EngineConfig's), then the server's."""

    served_model_name: Annotated[
        str | None, Field(description="the name clients send as `model` (default: --model)")
    ] = None
    host: Annotated[str, Field(description="address to listen on")] = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535, description="port to listen on (0: any free)")] = (
        8000
    )
    api_key: Annotated[
        str | None,
        Field(description=f"require `Authorization: Bearer KEY` (or set {ENV_PREFIX}API_KEY)"),
    ] = None
    max_queue: Annotated[
        int, Field(ge=1, description="requests that may wait for admission before new ones get 429")
    ] = 256
    cors_allow_origins: Annotated[
        list[str], Field(description="comma-separated origins allowed by CORS ('*' for any)")
    ] = []
    shutdown_timeout: Annotated[
        float, Field(ge=0, description="seconds in-flight requests may finish after SIGTERM")
    ] = 30.0
    max_body_bytes: Annotated[
        int, Field(ge=1, description="largest request body accepted (413 above)")
    ] = 4 << 20
    max_prompts_per_request: Annotated[
        int, Field(ge=1, description="most prompts in one /v1/completions request")
    ] = DEFAULT_LIMITS.max_prompts_per_request
    max_sequences_per_request: Annotated[
        int,
        Field(
            ge=1,
            description="most sequences one request fans out into: n for a chat request, "
            "prompts x n for a completions request (n alone is at most 16)",
        ),
    ] = DEFAULT_LIMITS.max_sequences_per_request
    max_tokens_per_request: Annotated[
        int | None,
        Field(
            ge=1,
            description="most tokens one request may ask for: the sum over its sequences of "
            "max_tokens, a chat request without one counting the context left after its prompt "
            f"(default: {CONTEXTS_PER_REQUEST} x max_model_len, so that a chat request with n up "
            f"to {CONTEXTS_PER_REQUEST} and no max_tokens always passes)",
        ),
    ] = None
    max_stop_sequences: Annotated[
        int, Field(ge=1, description="most stop strings in one request")
    ] = DEFAULT_LIMITS.max_stop_sequences
    max_logit_bias: Annotated[
        int, Field(ge=1, description="most logit_bias entries in one request")
    ] = DEFAULT_LIMITS.max_logit_bias
    header_timeout: Annotated[
        float,
        Field(gt=0, description="seconds a connection may take to send a request's headers"),
    ] = 30.0
    body_timeout: Annotated[
        float,
        Field(gt=0, description="seconds a client may take to send a whole request body (408)"),
    ] = 60.0
    max_drained_body_bytes: Annotated[
        int,
        Field(
            ge=0,
            description="bytes of a body over max_body_bytes read and dropped so that the 413 "
            "reaches the client (a connection closed on unread bytes is reset); past them, or "
            "past body_timeout, the connection is closed",
        ),
    ] = 64 << 20
    stream_stall_timeout: Annotated[
        float,
        Field(
            gt=0,
            description="seconds a response may wait on a client that reads nothing before the "
            "connection is closed and its requests aborted",
        ),
    ] = 30.0
    stream_one_token_per_chunk: Annotated[
        bool, Field(description="send one SSE chunk per token, not one per engine step")
    ] = False
    speculation_stats: Annotated[
        bool,
        Field(description="add speculative_decoding_stats to every choice (else per request)"),
    ] = False
    generation_config: Annotated[
        Literal["auto", "none"],
        Field(
            description="auto: a request that leaves out temperature, top_p, top_k, min_p or "
            "repetition_penalty gets the model's generation_config.json value (else OpenAI's "
            "default); none: OpenAI's defaults only",
        ),
    ] = "auto"
    tool_parser: Annotated[
        str,
        Field(
            description="how the model writes tool calls: auto (found from its chat template, "
            "else its model type), none (tool calls off), or " + ", ".join(tool_parser_names())
        ),
    ] = "auto"
    log_level: Annotated[LogLevel, Field(description="critical, error, warning, info or debug")] = (
        "info"
    )
    log_stats_interval: Annotated[
        float, Field(ge=0, description="seconds between engine stats log lines (0: none)")
    ] = 10.0

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
    def _valid_speculation(cls, value: Any) -> Any:
        # Checked with the rest of the settings, before the server binds: a bad one would
        # otherwise only fail once the model loads.
        if isinstance(value, Mapping):
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

    @field_validator("tool_parser")
    @classmethod
    def _known_parser(cls, value: str) -> str:
        if value not in tool_parser_choices():
            raise ValueError(f"must be one of {', '.join(tool_parser_choices())}")
        return value

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

    @property
    def model_name(self) -> str:
        """The name clients must send as `model`."""
        return self.served_model_name or self.model

    def request_limits(self) -> RequestLimits:
        """The per-request bounds among these settings."""
        names = {f.name for f in dataclasses.fields(RequestLimits)}
        return RequestLimits(**self.model_dump(include=names))

    def engine_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of `EngineConfig` (those left unset are left out), the
        speculative config parsed into a SpeculativeConfig."""
        values = self.model_dump(include=set(ENGINE_FIELDS))
        kwargs = {name: value for name, value in values.items() if value is not None}
        if "speculative_config" in kwargs:
            kwargs["speculative_config"] = SpeculativeConfig.parse(kwargs["speculative_config"])
        return kwargs

    def engine_config(self) -> EngineConfig:
        return EngineConfig(**self.engine_kwargs())


FIELDS = tuple(Settings.model_fields)


def add_settings_flags(parser: argparse.ArgumentParser, fields: tuple[str, ...] = FIELDS) -> None:
    """`--config` and one flag per settings field, its help the field's description; every
    default is None (= not given). A bool is `--x`/`--no-x`; an int or a float is converted here,
    so a malformed number is refused naming its flag; a Literal lists its choices."""
    parser.add_argument("--config", help="YAML settings file with engine: and server: sections")
    for name in fields:
        info = Settings.model_fields[name]
        kind = _flag_type(info.annotation)
        options: dict[str, Any] = {"dest": name, "default": None, "help": _flag_help(info)}
        if kind is bool:
            options["action"] = argparse.BooleanOptionalAction
        elif kind in (int, float):
            options["type"] = kind
        elif get_origin(kind) is Literal:
            options["choices"] = get_args(kind)
        parser.add_argument("--" + name.replace("_", "-"), **options)


def _flag_type(annotation: Any) -> Any:
    """The annotation without its None: a flag given always has a value."""
    if get_origin(annotation) in (Union, types.UnionType):
        kinds = [kind for kind in get_args(annotation) if kind is not type(None)]
        return kinds[0] if len(kinds) == 1 else None
    return annotation


def _flag_help(info: FieldInfo) -> str:
    text = info.description or ""
    default = info.default
    if isinstance(default, bool):
        text += f" (default: {'on' if default else 'off'})"
    elif not info.is_required() and default not in (None, []):
        text += f" (default: {default})"
    return text.replace("%", "%%")  # argparse formats help with %


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
