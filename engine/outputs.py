"""What the engine hands back: per-request outputs, cumulative and with the latest delta."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.spec.stats import SpecStats


@dataclass(frozen=True)
class TokenLogprob:
    """The logprob of one emitted token and the top alternatives at its position."""

    token_id: int
    logprob: float
    top_token_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@dataclass
class CompletionOutput:
    """One of the n completions of a request. `text`/`token_ids` are cumulative; `new_*` hold what
    the latest step added (what a stream sends)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    new_text: str = ""
    new_token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    spec_stats: SpecStats | None = None  # this completion's speculation counters

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one user request (all of its n completions) after a step."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False

    @property
    def num_cached_tokens(self) -> int:
        return max((o.num_cached_tokens for o in self.outputs), default=0)
