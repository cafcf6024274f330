"""What one step did for speculation (StepStats): the policy's decisions with their reasons,
the verify results, and the step's sizes and seconds.

`LLMEngine.step` ends with one immutable StepStats; the policy learns from it, and the counters
(engine/core/counters.py: the engine's SpecStats and PolicyStats, each request's SpecStats) add
it up.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    "paused",  # auto: a lookup whose drafts did not pay is tried again in a few steps
    "in_flight",  # the request's last token was still on the device (an overlapped step)
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
class DraftTiming:
    """Seconds of a model drafter's last propose: the first forward (catching up on
    num_catch_up tokens besides one per drafting request, num_drafting of them) and the
    num_more single-token forwards after it."""

    num_catch_up: int
    first_seconds: float
    num_more: int
    more_seconds: float
    num_drafting: int = 1


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
    # Decoding requests with a draft source that got k = 0 without a Decision of their own,
    # counted by reason (mode_off, paused): a step of mode off builds nothing per request.
    skipped: tuple[tuple[str, int], ...] = ()
    # Read back after the next step was launched (overlap scheduling): its overhead is the host
    # time the device did not cover.
    overlapped: bool = False
    # Ran eagerly where a decode step of as many tokens replays a CUDA graph (a prompt chunk
    # beside decodes on flash-attn): the step-time model learns it apart.
    off_graph: bool = False

    @property
    def seconds(self) -> float:
        """The step's time: forward, drafting and the rest."""
        return self.forward_seconds + self.draft_seconds + self.overhead_seconds

    @property
    def has_drafts(self) -> bool:
        return any(v.num_draft_tokens and not v.is_shadow for v in self.verifies)
