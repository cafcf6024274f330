"""An opt-in trace of every engine step, one JSON line each, for finding where a mode's time goes.

`SPECSERVE_STEP_TRACE=<path>` (read once, when the engine starts) appends one line per step to
<path>: when it ended (`t`, monotonic seconds), the policy's mode, the target forward's query
tokens, logits rows and attention reads, its seconds split as the policy sees them (forward and
verify, proposing, the rest), the forward the step-time model predicted for it and the correction
a step with drafts was priced with, the tokens the step added to outputs, how many requests it
scheduled and decided for, how many drafted and how many draft tokens the verify accepted, the
draft model's catch-up, and the count of each decision reason. The file is the operator's: the
engine only appends, and a write that fails turns the trace off (logged once) rather than fail a
step.

    SPECSERVE_STEP_TRACE=/tmp/steps.jsonl specserve serve ...
    python -m bench.policy.step_trace /tmp/steps.jsonl     # per mode: step time, tokens, overhead
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections import Counter
from typing import IO

from engine.core.stats import StepStats

logger = logging.getLogger(__name__)

ENV = "SPECSERVE_STEP_TRACE"


def step_record(
    stats: StepStats,
    num_scheduled: int,
    now: float,
    predicted: float = 0.0,
    correction: float = 1.0,
) -> dict[str, object]:
    """The trace's line for one step (its keys are bench/policy/step_trace.py's); `predicted`, the
    step-time model's forward seconds for the step's shape before it learned from the step, and
    `correction`, the factor a step with drafts was priced with (engine/policy/costs.py)."""
    drafting = [d for d in stats.decisions if d.num_draft_tokens > 0]
    verified = [v for v in stats.verifies if not v.is_shadow and v.num_draft_tokens]
    timing = stats.draft_timing
    return {
        "t": round(now, 6),
        "mode": stats.mode,
        "tokens": stats.num_tokens,
        "rows": stats.num_rows,
        "context": stats.context,
        "forward": round(stats.forward_seconds, 6),
        "predicted": round(predicted, 6),
        "correction": round(correction, 4),
        "draft": round(stats.draft_seconds, 6),
        "overhead": round(stats.overhead_seconds, 6),
        "generated": stats.num_generated,
        "scheduled": num_scheduled,
        "decided": len(stats.decisions),
        "drafting": len(drafting),
        "draft_tokens": sum(v.num_draft_tokens for v in verified),
        "accepted": sum(v.num_accepted for v in verified),
        "catch_up": sum(d.num_catch_up for d in stats.decisions),
        "draft_forward_catch_up": timing.num_catch_up if timing is not None else 0,
        "reasons": dict(Counter(d.reason for d in stats.decisions)),
    }


class StepTrace:
    """Appends step_record lines to a file; off (every call a no-op) without a path."""

    def __init__(self, path: str | None) -> None:
        self._file: IO[str] | None = None
        if path:
            self._file = open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115
            # Line-buffered: a server stopped by a signal keeps every step it ran.
            logger.info("tracing every engine step to %s", path)

    @classmethod
    def from_env(cls) -> StepTrace:
        return cls(os.environ.get(ENV) or None)

    @property
    def is_on(self) -> bool:
        return self._file is not None

    def write(
        self,
        stats: StepStats,
        num_scheduled: int,
        predicted: float = 0.0,
        correction: float = 1.0,
    ) -> None:
        if self._file is None:
            return
        try:
            record = step_record(stats, num_scheduled, time.monotonic(), predicted, correction)
            line = json.dumps(record)
            self._file.write(line + "\n")
        except (OSError, ValueError) as e:  # a full disk, a closed file: stop tracing
            logger.warning("step trace off: %s", e)
            self.close()

    def close(self) -> None:
        if self._file is not None:
            file, self._file = self._file, None
            with contextlib.suppress(OSError):
                file.close()
