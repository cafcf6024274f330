"""Speculation counters: plain data the engine fills and an exporter reads."""

from __future__ import annotations

from dataclasses import dataclass, field


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
