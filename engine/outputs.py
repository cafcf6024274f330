"""What the engine hands back: per step, what each request gained; and those deltas added up.

`LLMEngine.step()` returns, for every request it advanced, a `RequestOutput` that carries only
what that step added (tokens, text, logprobs) and O(1) counts: copying a request's whole output
every step would cost O(n²) over an output of n tokens. The engine never changes an output after
returning it, so one can cross threads as it is. Whoever wants whole outputs (`LLM`, a
non-streamed response) adds the deltas up once with an `OutputAccumulator`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from engine.core.counters import SpecStats


@dataclass(frozen=True)
class TokenLogprob:
    """The logprob of one emitted token and the top alternatives at its position."""

    token_id: int
    logprob: float
    top_token_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@dataclass(frozen=True)
class CompletionOutput:
    """One of the n completions of a request, as one output carries it.

    In an output of `LLMEngine.step()`, `text`, `token_ids` and `logprobs` are what that step
    added; in an accumulated output (what `LLM` returns), all of them so far.
    `num_output_tokens` counts every output token so far in both. `finish_reason`, `stop_reason`
    and `spec_stats` (the completion's speculation counters, a snapshot of their final values)
    are set from the output that finished the completion on; an aborted completion has no
    counters."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    spec_stats: SpecStats | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class RequestOutput:
    """One user request (all of its n completions): what a step added, or all of it so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False

    @property
    def num_cached_tokens(self) -> int:
        return max((o.num_cached_tokens for o in self.outputs), default=0)

    def aborted(self) -> RequestOutput:
        """The output that ends this request when it is aborted after this one: nothing new,
        and finish_reason "abort" on every completion that had not finished."""
        outputs = [
            replace(
                c,
                text="",
                token_ids=[],
                logprobs=None if c.logprobs is None else [],
                finish_reason=c.finish_reason or "abort",
            )
            for c in self.outputs
        ]
        return replace(self, outputs=outputs, finished=True)


class OutputAccumulator:
    """Adds the engine's per-step outputs up into whole ones, each piece copied once."""

    def __init__(self) -> None:
        self._parts: dict[str, list[_Parts]] = {}

    def add(self, delta: RequestOutput) -> RequestOutput | None:
        """Take a request's next output (in the order the engine made them). Returns the whole
        output when `delta` finishes the request (which it then forgets), else None."""
        parts = self._parts.setdefault(delta.request_id, [_Parts() for _ in delta.outputs])
        for part, c in zip(parts, delta.outputs, strict=True):
            part.add(c)
        if not delta.finished:
            return None
        del self._parts[delta.request_id]
        outputs = [part.whole(c) for part, c in zip(parts, delta.outputs, strict=True)]
        return replace(delta, outputs=outputs)

    def add_step(self, deltas: Iterable[RequestOutput]) -> list[RequestOutput]:
        """Take one step's outputs; the whole outputs of the requests it finished."""
        return [whole for delta in deltas if (whole := self.add(delta)) is not None]


class _Parts:
    """One completion's pieces so far."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []

    def add(self, c: CompletionOutput) -> None:
        if c.text:
            self.texts.append(c.text)
        self.token_ids += c.token_ids
        if c.logprobs:
            self.logprobs += c.logprobs

    def whole(self, last: CompletionOutput) -> CompletionOutput:
        return replace(
            last,
            text="".join(self.texts),
            token_ids=self.token_ids,
            logprobs=None if last.logprobs is None else self.logprobs,
        )
