"""Fakes for driving the speculation policy as the engine does: a step-time curve the tests
control, fixed acceptance estimates, a fixed device monitor, and a driver that decides a step
and feeds its final decisions back (StepStats), counting them as the engine does."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from engine.core.counters import PolicyStats
from engine.core.request import Request
from engine.core.schedule import Candidate, StepShape
from engine.core.stats import StepStats, VerifyResult
from engine.policy.acceptance import DEFAULT_PRIORS
from engine.policy.policy import SpeculationPolicy
from engine.sampling_params import SamplingParams

KNEE = 8


@dataclass
class FlatThenLinear:
    """A forward over 1..KNEE tokens costs one base step; past it, cost grows with n. Each logits
    row past the first costs row_cost more (the price of a draft token beyond the curve)."""

    base: float = 1.0
    row_cost: float = 0.0
    knee: int = KNEE

    def predict(self, n: int, context: int = 0, rows: int = 1) -> float:
        return self.base * max(1.0, n / KNEE) + self.row_cost * max(rows - 1, 0)

    def observe(self, n: int, context: int, seconds: float, rows: int = 1) -> None:
        """The fake does not learn: the tests control the curve."""


@dataclass
class FixedMonitor:
    value: float

    def utilization(self, num_step_tokens: int) -> float:
        return self.value


@dataclass
class FixedAlphas:
    """Acceptance estimates the test sets per request id (keys "<id>/<source>")."""

    alphas: dict[str, float] = field(default_factory=dict)
    priors: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_PRIORS))

    def alpha(self, key: str, source: str) -> float:
        return self.alphas[key.rpartition("/")[0]]

    def upper_bound(self, key: str, source: str) -> float:
        return self.alpha(key, source)

    def observe(self, key: str, source: str, num_draft_tokens: int, num_accepted: int) -> None:
        pass

    def tick(self) -> None:
        pass

    def forget(self, key: str) -> None:
        pass


def requests(num: int, **params) -> list[Request]:
    return [
        Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=64, **params), 64) for i in range(num)
    ]


def shape(num: int, budget: int = 256, context: int | None = None) -> StepShape:
    """A step of num decoding requests (one token and one logits row each)."""
    return StepShape(num, num, 100 * num if context is None else context, budget, num)


class Driver:
    """Decides steps with a policy and feeds each step's decisions (and any verify results)
    back, as LLMEngine.step does; `stats` counts them."""

    def __init__(self, policy: SpeculationPolicy) -> None:
        self.policy = policy
        self.stats = PolicyStats()

    def plan(
        self,
        candidates: Sequence[Candidate],
        step: StepShape,
        verifies: Sequence[VerifyResult] = (),
    ) -> list[int]:
        decisions = self.policy.decide(candidates, step)
        stats = StepStats(tuple(decisions), tuple(verifies), 0, 0, 0, 0.0, 0.0, 0.0)
        self.policy.observe(stats)
        self.stats.observe(stats)
        self.last_reasons = [d.reason for d in decisions]
        return [d.num_draft_tokens for d in decisions]

    def plan_requests(self, reqs: Sequence[Request], room: int = 7, source: str = "ngram"):
        return self.plan([Candidate(r, room, source) for r in reqs], shape(len(reqs)))

    def verify(self, request: Request, source: str, num_draft: int, num_accepted: int) -> None:
        """One verify result, fed as a step without decisions."""
        result = VerifyResult(request.request_id, source, num_draft, num_accepted)
        self.policy.observe(StepStats((), (result,), 0, 0, 0, 0.0, 0.0, 0.0))
