"""The engine's serving counters and latency histograms (`EngineMetrics`), plain data an
exporter reads (the engine never imports prometheus_client)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.core.counters import Histogram
from engine.core.request import Request
from engine.core.stats import StepStats

# Upper bounds in seconds. Request latencies span a 1 ms step on a GPU to minutes of queueing on
# a CPU (where one step takes ~0.2 s); inter-token latency is finer where CPU decode lands.
LATENCY_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0,
    60.0, 120.0, 300.0, 600.0,
)  # fmt: skip
INTER_TOKEN_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.125, 0.15, 0.2, 0.25, 0.3, 0.4,
    0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
# Drafting spans an n-gram lookup (microseconds) to several draft-model forwards.
STEP_PART_BUCKETS: tuple[float, ...] = (
    1e-05, 5e-05, 0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.25,
    0.3, 0.4, 0.5, 1.0, 2.5, 5.0,
)  # fmt: skip
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort")


def _histogram(bounds: tuple[float, ...]) -> Any:
    return field(default_factory=lambda: Histogram(bounds))


@dataclass
class EngineMetrics:
    """Serving counters and latency histograms, cumulative since the engine started.

    Units: a *sequence* is one of the n completions of a user request. Prompt tokens count once
    per user request (its sequences share the prompt), when its first sequence is first scheduled
    — the figure `usage.prompt_tokens` reports. Everything else is per sequence: generation
    tokens (output tokens kept, i.e. after a stop condition cut the step's tail), time to first
    token (from arrival), inter-token latency (a step appending m tokens t seconds after the
    previous one gives m samples of t/m, so there is one sample per token after the first),
    queue time (arrival to first scheduling; preemptions do not add samples), and finishes by
    reason. The end-to-end latency is observed for sequences that stop or reach their length,
    not for aborted ones (an abort's time is the client's, not the engine's); `num_finished`
    counts aborts too. Draft time has one sample per step in which some request was granted
    draft tokens (the proposers' time, lookups or draft-model forwards); verify time one per
    step that verified drafts (the target forward and verification).
    """

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_finished: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FINISH_REASONS, 0))
    time_to_first_token: Histogram = _histogram(LATENCY_BUCKETS)
    inter_token_latency: Histogram = _histogram(INTER_TOKEN_BUCKETS)
    e2e_request_latency: Histogram = _histogram(LATENCY_BUCKETS)
    request_queue_time: Histogram = _histogram(LATENCY_BUCKETS)
    draft_time: Histogram = _histogram(STEP_PART_BUCKETS)
    verify_time: Histogram = _histogram(STEP_PART_BUCKETS)
    # Engine steps, and those read back after the next was launched (overlap scheduling).
    num_steps: int = 0
    num_overlapped_steps: int = 0

    def record_scheduled(self, request: Request, now: float, is_first_of_group: bool) -> None:
        """A sequence scheduled for the first time at `now` (sets its first_scheduled_time)."""
        request.first_scheduled_time = now
        self.request_queue_time.observe(now - request.arrival_time)
        if is_first_of_group:
            self.num_prompt_tokens += request.num_prompt_tokens

    def record_tokens(self, request: Request, num_new: int, now: float) -> None:
        """num_new tokens appended to a sequence's output at `now` (sets its token times)."""
        if num_new <= 0:
            return
        self.num_generation_tokens += num_new
        last = request.last_token_time
        if last is None:
            request.first_token_time = last = now
            self.time_to_first_token.observe(now - request.arrival_time)
            num_new -= 1
        if num_new:
            self.inter_token_latency.observe((now - last) / num_new, num_new)
        request.last_token_time = now

    def observe_step(self, step: StepStats) -> None:
        """A step's drafting time (when some request was granted drafts) and verify time (when
        drafts were verified), and whether it overlapped."""
        self.num_steps += 1
        self.num_overlapped_steps += step.overlapped
        if any(d.num_draft_tokens for d in step.decisions):
            self.draft_time.observe(step.draft_seconds)
        if step.has_drafts:
            self.verify_time.observe(step.forward_seconds)

    def record_finished(self, request: Request, reason: str, now: float) -> None:
        """A sequence finished with `reason` (stop, length or abort) at `now`."""
        self.num_finished[reason] = self.num_finished.get(reason, 0) + 1
        if reason != "abort":
            self.e2e_request_latency.observe(now - request.arrival_time)
