"""Speculative decoding configuration, named as vLLM names it.

`method` names one proposer or a priority chain joined by '+': "ngram", "draft_model", "eagle3",
"ngram+draft_model" (n-gram first, the draft model where n-gram finds no match), "ngram+eagle3".
A chain holds at most one model drafter (draft_model or eagle3).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

SPEC_MODES = ("off", "always", "auto")
# Proposers that run a network with its own KV (engine/drafters/drafting_loop.py).
MODEL_DRAFTERS = ("draft_model", "eagle3")
# Draft length for predicted outputs when no speculative config sets one: a prediction is
# usually long and right, and verifying a token costs nothing while decode is memory-bound.
DEFAULT_PREDICTION_TOKENS = 8
# The methods a config may chain, each built by its factory in engine/drafters/registry.py: the
# lookups (prediction and grammar draft only for requests that bring a prediction or a grammar,
# as every engine's own sources do too), then the model drafters.
METHODS = ("ngram", "prediction", "grammar", *MODEL_DRAFTERS)


def check_mode(mode: object) -> None:
    """ValueError unless `mode` names a policy mode (the config's, or an operator's switch)."""
    if mode not in SPEC_MODES:
        raise ValueError(f"speculative mode must be one of {', '.join(SPEC_MODES)}.")


@dataclass(frozen=True)
class SpeculativeConfig:
    """How the engine drafts: which proposers, how many tokens, and the draft model."""

    method: str
    num_speculative_tokens: int = 3
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    model: str | None = None  # the draft model (name or path), or the EAGLE-3 head's directory
    draft_dtype: str | None = None  # default: the target's dtype
    # "q8_0": an EAGLE-3 head multiplies by Q8_0 blocks (CPU), float32 activations; "q6_k": by
    # Q6_K blocks, with the engine's gguf_activations (int8: integer dot products).
    draft_quantization: str | None = None
    # The draft model stops drafting for a request once it gives its own token less than this
    # probability (bench/spec.py: 0.6 with 5 tokens beat a fixed 3-token window on open chat).
    draft_min_confidence: float = 0.6
    # The draft model reads each prompt chunk in the step the target does, so a request that
    # goes on to draft has no catch-up left (on CUDA a catch-up chunk runs eagerly beside graph
    # steps); None: on CUDA. Off, the draft model catches up lazily, only for the requests the
    # policy lets it draft for (no prefill cost for the others: the CPU's choice).
    draft_follows_prefill: bool | None = None
    # The policy: "off" never drafts, "always" drafts num_speculative_tokens for every decoding
    # request, "auto" grants each request the k that maximises the step's predicted goodput.
    mode: str = "auto"
    # Operator limits (None: off): no speculation while this many requests run, or while the
    # device is at least this busy (0 to 1: the step's tokens over the calibrated compute-bound
    # knee, on every device; needs mode auto's calibration).
    spec_disable_batch_size: int | None = None
    spec_disable_utilization: float | None = None

    def __post_init__(self) -> None:
        for name in self.methods:
            if name not in METHODS:
                raise ValueError(
                    f"unknown speculative method {name!r}; choose from {sorted(METHODS)} "
                    "(or a chain such as 'ngram+draft_model')."
                )
        if len(set(self.methods)) != len(self.methods):
            raise ValueError(f"speculative method {self.method!r} names a proposer twice.")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(
                f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}."
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max.")
        if not 0.0 <= self.draft_min_confidence < 1.0:
            raise ValueError("draft_min_confidence must be in [0, 1).")
        check_mode(self.mode)
        if self.spec_disable_batch_size is not None and self.spec_disable_batch_size < 1:
            raise ValueError("spec_disable_batch_size must be at least 1.")
        utilization = self.spec_disable_utilization
        if utilization is not None and not 0.0 < utilization <= 1.0:
            raise ValueError("spec_disable_utilization must be in (0, 1].")
        if "draft_model" in self.methods and not self.model:
            raise ValueError("speculative method draft_model needs 'model' (the draft model).")
        if self.draft_quantization not in (None, "q8_0", "q6_k"):
            raise ValueError(
                "draft_quantization must be 'q8_0', 'q6_k' or unset, got "
                f"{self.draft_quantization!r}."
            )
        if self.draft_quantization and self.model_drafter != "eagle3":
            raise ValueError("draft_quantization applies to an EAGLE-3 head (method eagle3).")
        if "eagle3" in self.methods and not self.model:
            raise ValueError("speculative method eagle3 needs 'model' (the head's directory).")
        drafters = [m for m in self.methods if m in MODEL_DRAFTERS]
        if len(drafters) > 1:
            raise ValueError(
                f"speculative method {self.method!r} chains {' and '.join(drafters)}; a chain "
                "holds one model drafter."
            )

    @property
    def methods(self) -> tuple[str, ...]:
        return tuple(m.strip() for m in self.method.split("+"))

    @property
    def model_drafter(self) -> str | None:
        """The chain's model drafter (draft_model or eagle3), if any."""
        return next((m for m in self.methods if m in MODEL_DRAFTERS), None)

    @classmethod
    def parse(cls, value: Mapping[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """What the edges (LLM, the server's settings) hand the engine: a mapping parsed, a
        SpeculativeConfig or None as they are; ValueError naming what is wrong."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(
                f"speculative_config must be a mapping (JSON object), got {type(value).__name__}."
            )
        return cls.from_dict(value)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SpeculativeConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config keys: {', '.join(unknown)}.")
        if "method" not in data:
            raise ValueError("speculative_config needs 'method'.")
        return cls(**dict(data))
