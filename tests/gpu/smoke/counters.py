"""What the smoke bench counts on an engine without changing its code: where a point's steps
spent their time (StepBreakdown) and how many forwards replayed a CUDA graph (ReplayCounter), both
by wrapping methods of the engine's own instances."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine import LLMEngine
from engine.execution.cuda_graphs import NOT_CAPTURED


class StepBreakdown:
    """Where a point's steps spent their time, from the StepStats the engine hands its policy
    stats (wrapped on the instance, as ReplayCounter wraps the forwards): the target forward,
    drafting (lookups and draft-model forwards) and the rest, split by whether the step verified
    drafts; the share of steps that overlapped the next one's scheduling; the forward's achieved memory bandwidth (the bytes a step must read, the target's
    weights and the KV its attention reads, over the forward's device time: against the card's
    HBM bandwidth, how near the bandwidth limit the forward runs); and the policy's decisions
    by reason."""

    def __init__(self, engine: LLMEngine) -> None:
        runner = engine.runner
        self._weight_bytes = runner.weight_bytes
        self._kv_bytes_per_read = runner.model_config.kv_bytes_per_token * runner.dtype.itemsize
        self._stats = engine.policy_stats
        observe = self._stats.observe

        def observed(step: Any) -> None:
            self._add(step)
            observe(step)

        self._stats.observe = observed  # type: ignore[method-assign]
        self.reset()

    def reset(self) -> None:
        self._sums: dict[str, list[float]] = {}
        self._decisions_before = dict(self._stats.decisions)

    def _add(self, step: Any) -> None:
        if not step.num_tokens:
            return
        key = "with_drafts" if step.has_drafts else "without_drafts"
        sums = self._sums.setdefault(key, [0.0] * 7)
        read = self._weight_bytes + self._kv_bytes_per_read * step.context
        for i, value in enumerate(
            (
                1,
                step.num_tokens,
                step.forward_seconds,
                step.draft_seconds,
                step.overhead_seconds,
                read,
                step.overlapped,
            )
        ):
            sums[i] += value

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, (steps, tokens, forward, draft, rest, read, overlapped) in self._sums.items():
            out[key] = {
                "steps": int(steps),
                "tokens_per_step": round(tokens / steps, 1),
                "forward_ms": round(forward / steps * 1e3, 3),
                "draft_ms": round(draft / steps * 1e3, 3),
                "rest_ms": round(rest / steps * 1e3, 3),
                "read_mb_per_step": round(read / steps / 1e6, 1),
                "forward_gb_per_s": round(read / forward / 1e9, 1) if forward > 0 else None,
                # Steps read back after the next was launched (overlap scheduling); their
                # rest_ms is the host time the device did not cover.
                "overlap_share": round(overlapped / steps, 3),
            }
        decisions = {
            f"{d}/{r}": n - self._decisions_before.get((d, r), 0)
            for (d, r), n in self._stats.decisions.items()
        }
        out["decisions"] = {k: n for k, n in decisions.items() if n}
        return out


class ReplayCounter:
    """Counts a runner's forwards and those its CUDA graphs replayed, by wrapping the two
    `forward`s of the runner's instances (no engine code changes for a count)."""

    def __init__(self, runner: Any) -> None:
        self.num_forwards = 0
        self.num_replays = 0
        # A model's forward, and an EAGLE-3 head's two (its drafts, its K/V-only extend).
        for name, graphed in (
            ("forward", "forward"),
            ("hidden_forward", "hidden_states"),
            ("kv_forward", "kv_states"),
        ):
            if hasattr(runner, name):
                setattr(runner, name, self._counting(getattr(runner, name), self._count_forward))
            if runner.graphs is not None and hasattr(runner.graphs, graphed):
                counted = self._counting(getattr(runner.graphs, graphed), self._count_replay)
                setattr(runner.graphs, graphed, counted)

    @staticmethod
    def _counting(forward: Callable[..., Any], count: Callable[[Any], None]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            result = forward(*args, **kwargs)
            count(result)
            return result

        return counted

    def _count_forward(self, result: Any) -> None:
        self.num_forwards += 1

    def _count_replay(self, result: Any) -> None:
        self.num_replays += result is not NOT_CAPTURED

    def reset(self) -> None:
        self.num_forwards = self.num_replays = 0

    @property
    def share(self) -> float | None:
        """Replayed over all forwards; None where the runner ran none (the policy never chose
        the draft model), which a share of 0 would read as graphs that never replay."""
        return self.num_replays / self.num_forwards if self.num_forwards else None
