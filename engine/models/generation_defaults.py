"""Sampling defaults from a model's `generation_config.json` (Hugging Face's format).

A model's authors often ship the sampling they tuned it for (Qwen2.5's instruct models give a
temperature, top_p, top_k and repetition_penalty). vLLM applies those by default, and so does the
server here: they stand in for the fields a request leaves out (`server/engine_inputs.py`).

Read from the file: `temperature`, `top_p`, `top_k`, `min_p` and `repetition_penalty`; a key
that is absent or null gives no default. One more rule, from Hugging Face's own meaning of the
file: an explicit `do_sample: false` means greedy, so without a `temperature` it is the default
temperature 0 (with one, the temperature stands, as vLLM reads it). Everything else in the file
(max_new_tokens, eos ids, ...) is not a sampling default here; the eos ids are read elsewhere
(`engine.text.tokenizer.config_eos_token_ids`).

A value of the wrong type or outside what a request may ask (temperature in [0, 2], top_p in
(0, 1], top_k an integer >= -1, min_p in [0, 1], repetition_penalty in (0, 2]) raises
ValueError naming the file and the key: as a default it would make every request fail.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

FILE_NAME = "generation_config.json"


@dataclass(frozen=True)
class GenerationDefaults:
    """Per-field sampling defaults of a model; None: the model gives none for that field."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None

    def __post_init__(self) -> None:
        for name, low, high, open_low in _RANGES:
            value = getattr(self, name)
            if value is not None:
                # JSON writes 1 for 1.0: stored as a float either way.
                object.__setattr__(self, name, _in_range(name, value, low, high, open_low))
        top_k = self.top_k
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int)):
            raise ValueError(f"top_k must be an integer, got {top_k!r}.")
        if top_k is not None and top_k < -1:
            raise ValueError(f"top_k must be at least -1 (-1 or 0: off), got {top_k}.")

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> GenerationDefaults:
        """The defaults among a parsed generation config's keys (see the module docstring)."""
        values = {f.name: config.get(f.name) for f in fields(cls)}
        if config.get("do_sample") is False and values["temperature"] is None:
            values["temperature"] = 0.0
        return cls(**values)

    def given(self) -> dict[str, float | int]:
        """The fields this model gives a default for (for logging)."""
        items = ((f.name, getattr(self, f.name)) for f in fields(self))
        return {name: value for name, value in items if value is not None}


def load_generation_defaults(model_dir: str | Path) -> GenerationDefaults:
    """The defaults in `model_dir`'s generation_config.json; none when the file is absent.
    Raises ValueError, naming the file, for one that is malformed or has unusable values."""
    path = Path(model_dir) / FILE_NAME
    if not path.is_file():
        return GenerationDefaults()
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(config, dict):
            raise ValueError("expected a JSON object")
        defaults = GenerationDefaults.from_dict(config)
    except ValueError as e:  # json.JSONDecodeError is one
        raise ValueError(
            f"{path}: {e} (fix the file, or serve without it: --generation-config none)"
        ) from None
    if defaults.given():  # requests without these fields will sample differently: say so
        logger.info("sampling defaults from %s: %s", path, defaults.given())
    return defaults


# (name, low, high, whether low itself is excluded): the ranges a request may ask for.
_RANGES = (
    ("temperature", 0.0, 2.0, False),
    ("top_p", 0.0, 1.0, True),
    ("min_p", 0.0, 1.0, False),
    ("repetition_penalty", 0.0, 2.0, True),
)


def _in_range(name: str, value: Any, low: float, high: float, open_low: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a number, got {value!r}.")
    if value > high or value < low or (open_low and value == low):
        bracket = "(" if open_low else "["
        raise ValueError(f"{name} must be in {bracket}{low:g}, {high:g}], got {value}.")
    return float(value)
