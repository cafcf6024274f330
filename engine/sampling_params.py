"""Per-request sampling parameters, named as vLLM names them.

`SamplingParams` is immutable and validated where it is built: an out-of-range value raises
`ValueError` with a message that names the field, so the HTTP layer can turn it into a 400.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from engine.structured.spec import StructuredOutput

# Seeds are fed to torch.Generator.manual_seed, which takes a 64-bit value.
_MAX_SEED = 2**64 - 1
_MAX_LOGPROBS = 20


def _as_str_tuple(value: str | Sequence[str] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    return tuple(value)


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops.

    temperature 0 means greedy decoding. top_k <= 0 (or -1) disables top-k. `stop` strings are
    excluded from the returned text. `max_tokens=None` means "up to the context length".
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    ignore_eos: bool = False
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    skip_special_tokens: bool = True
    # Speculation controls (the `speculation` API extension): opt out, or cap the draft length.
    speculate: bool = True
    max_draft_tokens: int | None = None
    # A constraint the output must match (JSON schema, JSON object, tagged tool calls).
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        # Normalise container fields so that the object is hashable-ish and truly immutable.
        object.__setattr__(self, "stop", _as_str_tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        bias = {int(k): float(v) for k, v in dict(self.logit_bias or {}).items()}
        object.__setattr__(self, "logit_bias", MappingProxyType(bias))
        if self.top_k < 0:
            object.__setattr__(self, "top_k", 0)
        self._validate()

    def _validate(self) -> None:
        def fail(name: str, msg: str) -> None:
            raise ValueError(f"{name} {msg}")

        if not isinstance(self.n, int) or self.n < 1:
            fail("n", f"must be at least 1, got {self.n}.")
        if not 0.0 <= self.temperature <= 100.0:
            fail("temperature", f"must be in [0, 100], got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            fail("top_p", f"must be in (0, 1], got {self.top_p}.")
        if not 0.0 <= self.min_p <= 1.0:
            fail("min_p", f"must be in [0, 1], got {self.min_p}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            fail("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            fail("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}.")
        if not 0.0 < self.repetition_penalty <= 2.0:
            fail("repetition_penalty", f"must be in (0, 2], got {self.repetition_penalty}.")
        if self.seed is not None and not 0 <= self.seed <= _MAX_SEED:
            fail("seed", f"must be in [0, 2**64 - 1], got {self.seed}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            fail("max_tokens", f"must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            fail("min_tokens", f"must be at least 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail(
                "min_tokens", f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})."
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= _MAX_LOGPROBS:
            fail("logprobs", f"must be in [0, {_MAX_LOGPROBS}], got {self.logprobs}.")
        if self.max_draft_tokens is not None and self.max_draft_tokens < 0:
            fail("max_draft_tokens", f"must be at least 0, got {self.max_draft_tokens}.")
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            fail("structured", "must be a StructuredOutput.")
        if any(not s for s in self.stop):
            fail("stop", "must not contain empty strings.")
        if any(t < 0 for t in self.stop_token_ids):
            fail("stop_token_ids", "must be non-negative token ids.")
        for token_id, bias in self.logit_bias.items():
            if token_id < 0:
                fail("logit_bias", f"has a negative token id {token_id}.")
            if not -100.0 <= bias <= 100.0:
                fail("logit_bias", f"values must be in [-100, 100], got {bias}.")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def validate_for_vocab(self, vocab_size: int) -> None:
        """Token ids named by the request must exist in the model's vocabulary."""
        for token_id in (*self.stop_token_ids, *self.logit_bias.keys()):
            if token_id >= vocab_size:
                raise ValueError(
                    f"token id {token_id} is outside the vocabulary (size {vocab_size})."
                )
