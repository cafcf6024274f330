"""Speculation counters: plain data the engine fills and an exporter reads."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.metrics import Histogram


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
    draft_time: float = 0.0  # seconds spent proposing
    verify_time: float = 0.0  # seconds of target forwards + verification in steps with drafts

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

    Each step, every decoding request gets one decision: "speculate" (k > 0) with reason
    "goodput" (auto) or "fixed" (always), or "skip" (k = 0) with the reason: request_opt_out,
    batch_size, utilization, compute_bound, low_acceptance, or mode_off.
    """

    decisions: dict[tuple[str, str], int] = field(default_factory=dict)  # (decision, reason)
    draft_tokens_per_step: Histogram = field(
        default_factory=lambda: Histogram(DRAFT_TOKENS_BUCKETS)
    )
    num_requests_speculating: int = 0  # decoding requests granted k > 0 in the latest step
    num_requests_decoding: int = 0  # decoding requests in the latest step

    def record(self, num_draft_tokens: int, decision: str, reason: str) -> None:
        key = (decision, reason)
        self.decisions[key] = self.decisions.get(key, 0) + 1
        self.draft_tokens_per_step.observe(num_draft_tokens)
