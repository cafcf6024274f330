"""The measurements of bench/policy/run.py, kept free of I/O so tests can check them: per request
the arrival time of every streamed token (the server is started with one SSE chunk per token),
read from the stream by ChatStreamReader. A level holds its concurrency for a fixed window: its
throughput counts the tokens that arrived inside the window, whether their request finished there
or was cut off at its end. Per level also the percentiles over requests (TTFT) and over tokens
(inter-token latency) inside the window, and the share of the policy's per-request decisions that
speculated (from the server's counters, bench/policy/counters.py).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RequestResult:
    """One streamed request: token times and latency are seconds after it was sent, at `sent_at`
    (the bench's clock). A request cut off at the end of its level's window is `cancelled`."""

    prompt_index: int
    token_times: tuple[float, ...]  # arrival of each streamed token (content chunk)
    num_completion_tokens: int  # from usage; the number of chunks when usage is missing
    latency: float
    error: str | None = None
    sent_at: float = 0.0
    cancelled: bool = False

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    def tokens_within(self, start: float, end: float) -> list[float]:
        """Arrival times (relative to sending) of the tokens that arrived in [start, end]."""
        return [t for t in self.token_times if start <= self.sent_at + t <= end]


@dataclass(frozen=True)
class LevelResult:
    """One (mode, workload, concurrency) level of the sweep; latencies in seconds."""

    mode: str
    workload: str
    concurrency: int
    num_requests: int  # finished inside the window
    num_errors: int
    num_completion_tokens: int  # streamed inside the window
    wall_time: float  # the window
    tokens_per_s: float
    ttft_p50: float | None
    ttft_p99: float | None
    itl_p50: float | None
    itl_p99: float | None
    speculating_share: float | None  # None: the server exports no policy decisions
    num_cancelled: int = 0  # still streaming when the window closed
    round: int = 0  # which of the run's rounds (each round measures every mode once per level)


class StreamError(RuntimeError):
    """The server ended a stream with an error event."""


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between closest ranks (numpy's default); None if
    there are no values."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def amortized_itl(token_times: Sequence[float], burst_gap: float) -> list[float]:
    """Inter-token latencies, one per token after the first burst.

    Tokens of one engine step (a verify step emits several) arrive together: a token within
    `burst_gap` seconds of the previous one joins its burst. A burst of m tokens arriving `gap`
    seconds after the previous burst began gives each of its tokens gap / m, so the latencies
    sum to the time between the first and the last burst, as a client sees the stream advance.
    """
    bursts: list[tuple[float, int]] = []  # (arrival of its first token, tokens)
    previous = None
    for t in token_times:
        if previous is not None and t - previous <= burst_gap:
            bursts[-1] = (bursts[-1][0], bursts[-1][1] + 1)
        else:
            bursts.append((t, 1))
        previous = t
    latencies = []
    for (start_before, _), (start, count) in zip(bursts, bursts[1:], strict=False):
        latencies += [(start - start_before) / count] * count
    return latencies


def parse_sse_line(line: str) -> dict[str, Any] | str | None:
    """One line of a `text/event-stream`: the event's JSON object, "[DONE]", or None for lines
    that carry no data (blank separators, comments, other fields)."""
    if not line.startswith("data:"):
        return None
    payload = line[len("data:") :].strip()
    if payload == "[DONE]":
        return payload
    event = json.loads(payload)
    if not isinstance(event, dict):
        raise StreamError(f"unexpected event {payload[:200]!r}")
    return event


class ChatStreamReader:
    """Reads one streamed chat completion line by line, times its tokens and keeps its text."""

    def __init__(self, sent_at: float) -> None:
        self.sent_at = sent_at
        self.token_times: list[float] = []
        self.pieces: list[str] = []  # the content of each token's chunk
        self.num_usage_tokens: int | None = None
        self.is_done = False

    def feed(self, line: str, now: float) -> None:
        """Take one line received at `now` (same clock as `sent_at`). Raises StreamError on an
        error event."""
        event = parse_sse_line(line)
        if event is None:
            return
        if event == "[DONE]":
            self.is_done = True
            return
        assert isinstance(event, dict)
        if "error" in event:
            raise StreamError(str(event["error"].get("message", event["error"])))
        usage = event.get("usage")
        if usage:
            self.num_usage_tokens = int(usage["completion_tokens"])
        for choice in event.get("choices") or []:
            if content := (choice.get("delta") or {}).get("content"):
                self.token_times.append(now - self.sent_at)
                self.pieces.append(content)

    @property
    def text(self) -> str:
        """The content streamed so far."""
        return "".join(self.pieces)

    def result(self, prompt_index: int, now: float) -> RequestResult:
        tokens = self.num_usage_tokens
        return RequestResult(
            prompt_index=prompt_index,
            token_times=tuple(self.token_times),
            num_completion_tokens=len(self.token_times) if tokens is None else tokens,
            latency=now - self.sent_at,
            sent_at=self.sent_at,
        )


def summarize_level(
    mode: str,
    workload: str,
    concurrency: int,
    results: Sequence[RequestResult],
    window: tuple[float, float],
    share: float | None,
    burst_gap: float,
) -> LevelResult:
    """Aggregate a level over its window (start, end) on the bench's clock: tokens/s counts the
    tokens that arrived inside it (of finished and cut-off requests alike), TTFT percentiles
    cover the requests whose first token arrived inside it, ITL percentiles the tokens inside it.
    Failed requests count as errors only."""
    start, end = window
    ok = [r for r in results if r.error is None]
    inside = [r.tokens_within(start, end) for r in ok]
    ttfts = [r.ttft for r, times in zip(ok, inside, strict=True) if times and times[0] == r.ttft]
    itls = [x for times in inside for x in amortized_itl(times, burst_gap)]
    num_tokens = sum(len(times) for times in inside)
    wall_time = end - start
    return LevelResult(
        mode=mode,
        workload=workload,
        concurrency=concurrency,
        num_requests=sum(1 for r in ok if not r.cancelled),
        num_errors=len(results) - len(ok),
        num_completion_tokens=num_tokens,
        wall_time=wall_time,
        tokens_per_s=num_tokens / wall_time if wall_time > 0 else 0.0,
        ttft_p50=percentile(ttfts, 50),
        ttft_p99=percentile(ttfts, 99),
        itl_p50=percentile(itls, 50),
        itl_p99=percentile(itls, 99),
        speculating_share=share,
        num_cancelled=sum(1 for r in ok if r.cancelled),
    )
