"""The speculator: builds the proposer chain from the config and drafts once per step.

Requests that carry a prediction (OpenAI Predicted Outputs) draft from it first; the rest go
through the configured chain in order ("ngram+draft_model": n-gram first, the draft model for
the requests n-gram found nothing for). Every proposer sees every step (`prepare`), so a draft
model stays in sync with requests that are not speculating.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.request import Request
from engine.runner import SeqChunk
from engine.scheduler import ScheduledRequest
from engine.spec.config import SpeculativeConfig
from engine.spec.proposer import Draft, Proposer, make_proposer
from engine.spec.stats import PolicyStats, SpecStats

# Draft length for predicted outputs when no speculative config sets one: a prediction is
# usually long and right, and verifying a token costs nothing while decode is memory-bound.
DEFAULT_PREDICTION_TOKENS = 8


@dataclass(frozen=True)
class ProposerContext:
    """What a proposer factory may need from the engine (a draft model needs all of it)."""

    engine: Any  # the LLMEngine being built: config, model_config, block_manager, max_model_len


class Speculator:
    """Runs the proposers each step; owns the speculation counters."""

    def __init__(self, config: SpeculativeConfig | None, context: ProposerContext) -> None:
        self.config = config
        self.chain: list[Proposer] = [
            make_proposer(name, spec=config, context=context)
            for name in (config.methods if config else ())
        ]
        self.prediction = make_proposer("prediction", spec=config, context=context)
        self.num_tokens = config.num_speculative_tokens if config else DEFAULT_PREDICTION_TOKENS
        self.stats = SpecStats()
        self.policy_stats = PolicyStats()

    def draft_length(self, request: Request) -> int:
        """Draft tokens a decoding request may verify this step (a fixed K for now)."""
        if request.prediction_token_ids or self.chain:
            return self.num_tokens
        return 0

    def propose(self, scheduled: Sequence[ScheduledRequest]) -> dict[str, Draft]:
        start = time.perf_counter()
        pairs = [(s.request, s.num_new_tokens) for s in scheduled]
        for proposer in (self.prediction, *self.chain):
            proposer.prepare(pairs)
        pending = [(s.request, s.num_draft_tokens) for s in scheduled if s.num_draft_tokens > 0]
        drafts: dict[str, Draft] = {}
        predicted = [(r, k) for r, k in pending if r.prediction_token_ids]
        self._ask(self.prediction, predicted, drafts)
        pending = [(r, k) for r, k in pending if r.request_id not in drafts]
        for proposer in self.chain:
            # Called even with nothing pending: a draft model catches up every step.
            self._ask(proposer, pending, drafts)
            pending = [(r, k) for r, k in pending if r.request_id not in drafts]
        self.stats.draft_time += time.perf_counter() - start
        return drafts

    @staticmethod
    def _ask(
        proposer: Proposer, pending: list[tuple[Request, int]], drafts: dict[str, Draft]
    ) -> None:
        results = proposer.propose([r for r, _ in pending], [k for _, k in pending])
        for (request, k), draft in zip(pending, results, strict=True):
            if draft is not None:
                assert len(draft.token_ids) <= k, f"{proposer.name} drafted past its grant"
                drafts[request.request_id] = draft

    def num_cacheable_tokens(self, request: Request, num_computed: int) -> int:
        """Leading tokens whose KV is complete in every model (target and drafts)."""
        for proposer in self.chain:
            num_kv = proposer.num_kv_tokens(request)
            if num_kv is not None:
                num_computed = min(num_computed, num_kv)
        return num_computed

    def observe_step(self, chunks: Sequence[SeqChunk], seconds: float) -> None:
        """One measured target forward (and verification) over `chunks`."""

    def free(self, request: Request) -> None:
        for proposer in (self.prediction, *self.chain):
            proposer.free(request)
