"""What the speculation policy's unit tests share: a step of `base` decoding requests (one query
token and one logits row each, no KV reads) whose token budget for drafts is unbounded unless
given."""

from __future__ import annotations

from engine.core.schedule import StepShape


def _shape(base: int, budget: int | None = None) -> StepShape:
    return StepShape(base, base, 0, 10**9 if budget is None else budget, base)
