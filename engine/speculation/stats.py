"""What one step did for speculation (StepStats), and the counters that add it up.

`LLMEngine.step` ends with one immutable StepStats; the policy learns from it, the engine's
SpecStats and PolicyStats and each request's SpecStats count from it. Plain data: an exporter
reads the counters (the engine never imports prometheus_client).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.metrics import Histogram

if TYPE_CHECKING:
    from engine.speculation.model_drafter import DraftTiming

# Why a decoding request was granted k > 0 ("speculate") this step...
SPECULATE_REASONS: tuple[str, ...] = (
    "goodput",  # auto: the drafts raise the step's predicted goodput
    "fixed",  # always: the request's cap
)
# ... or k = 0 ("skip").
SKIP_REASONS: tuple[str, ...] = (
    "request_opt_out",  # the request asked for no drafts
    "batch_size",  # the running batch reached spec_disable_batch_size
    "utilization",  # the device is at least spec_disable_utilization busy
    "compute_bound",  # drafts would pay alone, not in this step's batch
    "catch_up",  # the draft model catches up on the request first, a bounded chunk per step
    "catch_up_cost",  # drafts would pay once the draft model is current, not its catch-up
    "low_acceptance",  # drafts would not pay even alone
    "budget",  # always: the step's token budget is spent
    "kv_cache_full",  # granted, but the KV pool had no room for the drafts
    "mode_off",  # off
)


@dataclass(frozen=True)
class Decision:
    """The policy's final word on one decoding request with a draft source, for one step."""

    request_id: str
    source: str
    num_draft_tokens: int
    reason: str
    # Tokens the draft model catches up on for the request this step: what it missed, before
    # drafting (k > 0), or a chunk of it (reason catch_up); within the policy's per-step chunk.
    num_catch_up: int = 0

    @property
    def decision(self) -> str:
        return "speculate" if self.num_draft_tokens > 0 else "skip"


@dataclass(frozen=True)
class VerifyResult:
    """One request's drafts this step and how many the verify accepted. A shadow draft is a
    lookup draft the policy did not grant: never verified, its first token is checked against
    the token the step emitted (with one-hot drafts the verify accepts exactly on a match), so a
    paused request's estimate keeps learning; only the policy reads shadows."""

    request_id: str
    source: str
    num_draft_tokens: int
    num_accepted: int
    num_cut: int = 0  # accepted, but after a stop condition ended the output
    is_shadow: bool = False


@dataclass(frozen=True)
class StepStats:
    """One step, once its device work has finished."""

    decisions: tuple[Decision, ...]
    verifies: tuple[VerifyResult, ...]
    num_tokens: int  # query tokens of the target forward
    num_rows: int  # logits rows it computed
    context: int  # the attention's KV reads (step_time.attention_reads, summed over chunks)
    forward_seconds: float  # the target forward and the verify, device time
    draft_seconds: float  # proposing (lookups, draft-model forwards)
    overhead_seconds: float  # the rest of the step: scheduling, bookkeeping
    draft_timing: DraftTiming | None = None  # the draft model's forwards, when it ran
    mode: str = "auto"  # the policy's mode the step was decided in (off / always / auto)
    num_generated: int = 0  # tokens the step appended to outputs (after stop conditions)

    @property
    def seconds(self) -> float:
        """The step's time: forward, drafting and the rest."""
        return self.forward_seconds + self.draft_seconds + self.overhead_seconds

    @property
    def has_drafts(self) -> bool:
        return any(v.num_draft_tokens and not v.is_shadow for v in self.verifies)


@dataclass
class SpecStats:
    """Speculation counters, cumulative for the engine or for one request.

    "Accepted" counts drafts kept (the recovered or bonus token excluded); a draft token accepted
    but cut because a stop condition ended the output before it counts in num_cut_by_stop.
    """

    num_drafts: int = 0  # verify steps with at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [i]: steps accepting position i+1
    acceptance_histogram: list[int] = field(default_factory=list)  # [a]: steps accepting exactly a
    num_cut_by_stop: int = 0
    num_prediction_accepted: int = 0
    num_prediction_rejected: int = 0
    # Per draft source (ngram, draft_model, eagle3, prediction, grammar): [draft tokens, accepted].
    by_source: dict[str, list[int]] = field(default_factory=dict)
    draft_time: float = 0.0  # seconds spent proposing
    verify_time: float = 0.0  # seconds of target forwards + verification in steps with drafts

    def observe(self, step: StepStats) -> None:
        """Count a step's verified drafts (not its shadows) and its times."""
        for v in step.verifies:
            if not v.is_shadow:
                self.record(v.num_draft_tokens, v.num_accepted, v.source, v.num_cut)
        if any(d.num_draft_tokens for d in step.decisions):
            self.draft_time += step.draft_seconds
        if step.has_drafts:
            self.verify_time += step.forward_seconds

    def record(
        self, num_draft_tokens: int, num_accepted: int, source: str, num_cut: int = 0
    ) -> None:
        if num_draft_tokens == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_draft_tokens:
            self.accepted_per_pos.extend([0] * (num_draft_tokens - len(self.accepted_per_pos)))
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1
        if len(self.acceptance_histogram) <= num_accepted:
            self.acceptance_histogram.extend(
                [0] * (num_accepted + 1 - len(self.acceptance_histogram))
            )
        self.acceptance_histogram[num_accepted] += 1
        self.num_cut_by_stop += num_cut
        counts = self.by_source.setdefault(source, [0, 0])
        counts[0] += num_draft_tokens
        counts[1] += num_accepted
        if source == "prediction":
            self.num_prediction_accepted += num_accepted
            self.num_prediction_rejected += num_draft_tokens - num_accepted

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verify step: accepted drafts + the recovered or bonus token."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


# k per request per step: the buckets of spec_decode_draft_tokens_per_step (upper bounds).
DRAFT_TOKENS_BUCKETS: tuple[float, ...] = (0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16)


@dataclass
class PolicyStats:
    """What the speculation policy decided, cumulative for the engine.

    Each step, every decoding request with a draft source gets one decision: "speculate"
    (k > 0) with a reason of SPECULATE_REASONS, or "skip" (k = 0) with one of SKIP_REASONS.
    Every step also counts, under the mode it was decided in, its seconds and the tokens it
    generated: what each mode earns while it runs, when an operator switches modes on a live
    server (bench/policy.py compares modes that way, slice by slice under one load).
    """

    decisions: dict[tuple[str, str], int] = field(default_factory=dict)  # (decision, reason)
    draft_tokens_per_step: Histogram = field(
        default_factory=lambda: Histogram(DRAFT_TOKENS_BUCKETS)
    )
    num_requests_speculating: int = 0  # decoding requests granted k > 0 in the latest step
    num_requests_decoding: int = 0  # decoding requests in the latest step
    mode_seconds: dict[str, float] = field(default_factory=dict)  # mode -> seconds of its steps
    mode_tokens: dict[str, int] = field(default_factory=dict)  # mode -> tokens its steps made

    def observe(self, step: StepStats) -> None:
        if step.num_tokens:
            self.mode_seconds[step.mode] = self.mode_seconds.get(step.mode, 0.0) + step.seconds
            self.mode_tokens[step.mode] = self.mode_tokens.get(step.mode, 0) + step.num_generated
        for d in step.decisions:
            key = (d.decision, d.reason)
            self.decisions[key] = self.decisions.get(key, 0) + 1
            self.draft_tokens_per_step.observe(d.num_draft_tokens)
        if step.decisions or step.num_tokens:
            self.num_requests_decoding = len(step.decisions)
            self.num_requests_speculating = sum(1 for d in step.decisions if d.num_draft_tokens)
