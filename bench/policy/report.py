"""bench/policy/run.py's report: the markdown tables per workload (tokens/s, the median over the
rounds and its range, relative to off; TTFT, inter-token latency, share speculating), auto
against the better fixed mode at each workload's concurrency (paired by round, and pooled over
the rounds), the verdict on the targets (on the medians; the mixed workload and code edit at
c = 1), and the PNG plot. It
reads finished LevelResults only; the run itself (the server, the clients) stays in
bench/policy/run.py."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.policy.measurements import LevelResult

AUTO_TOLERANCE = 0.03  # auto may trail the better fixed mode by this much
CODE_EDIT_TARGET = 1.5  # auto over off, code edit at concurrency 1
FIXED_MODES = ("off", "always")  # auto is judged against the better of those measured
TITLES = {  # the report's heading of each workload of bench/policy/workload.py
    "mixed": "Mixed workload (code edit + open chat)",
    "code_edit": "Code edit only",
    "open_chat": "Open chat only",
    "code_gen": "Code generation (functions to complete)",
}


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def _median(values: Sequence[float]) -> float:
    return statistics.median(values)


def _median_or_none(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def rounds_of(levels: Sequence[LevelResult]) -> dict[tuple[str, str, int], list[LevelResult]]:
    """(mode, workload, concurrency) -> its windows, one per round, in round order."""
    out: dict[tuple[str, str, int], list[LevelResult]] = {}
    for r in sorted(levels, key=lambda r: r.round):
        out.setdefault((r.mode, r.workload, r.concurrency), []).append(r)
    return out


def combined(levels: Sequence[LevelResult]) -> list[LevelResult]:
    """One LevelResult per (mode, workload, concurrency): the median over its rounds of tokens/s,
    latencies and share speculating; the counts summed."""
    out = []
    for (mode, workload, c), runs in rounds_of(levels).items():
        out.append(
            LevelResult(
                mode=mode,
                workload=workload,
                concurrency=c,
                num_requests=sum(r.num_requests for r in runs),
                num_errors=sum(r.num_errors for r in runs),
                num_completion_tokens=sum(r.num_completion_tokens for r in runs),
                wall_time=sum(r.wall_time for r in runs),
                tokens_per_s=_median([r.tokens_per_s for r in runs]),
                ttft_p50=_median_or_none([r.ttft_p50 for r in runs]),
                ttft_p99=_median_or_none([r.ttft_p99 for r in runs]),
                itl_p50=_median_or_none([r.itl_p50 for r in runs]),
                itl_p99=_median_or_none([r.itl_p99 for r in runs]),
                speculating_share=_median_or_none([r.speculating_share for r in runs]),
                num_cancelled=sum(r.num_cancelled for r in runs),
                round=len(runs),  # here: how many rounds the medians are over
            )
        )
    return out


def format_table(levels: Sequence[LevelResult]) -> str:
    """Markdown: one row per (concurrency, mode) of one workload: tokens/s (the median over the
    rounds, and its range when there are several) relative to off, latencies, share."""
    spread = {k: [r.tokens_per_s for r in runs] for k, runs in rounds_of(levels).items()}
    levels = combined(levels)
    base = {(r.workload, r.concurrency): r.tokens_per_s for r in levels if r.mode == "off"}
    lines = [
        "| c | mode | tok/s | range | vs off | TTFT p50 ms | TTFT p99 ms | ITL p50 ms "
        "| ITL p99 ms | % speculating | errors |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    order = {"off": 0, "always": 1, "auto": 2}
    for r in sorted(levels, key=lambda r: (r.concurrency, order.get(r.mode, len(order)))):
        off = base.get((r.workload, r.concurrency))
        ratio = f"{r.tokens_per_s / off:.2f}x" if off else "-"
        share = "-" if r.speculating_share is None else f"{100 * r.speculating_share:.0f}%"
        values = spread[(r.mode, r.workload, r.concurrency)]
        span = f"{min(values):.2f}-{max(values):.2f}" if len(values) > 1 else "-"
        lines.append(
            f"| {r.concurrency} | {r.mode} | {r.tokens_per_s:.2f} | {span} | {ratio} "
            f"| {_ms(r.ttft_p50)} | {_ms(r.ttft_p99)} | {_ms(r.itl_p50)} | {_ms(r.itl_p99)} "
            f"| {share} | {r.num_errors} |"
        )
    return "\n".join(lines)


@dataclass(frozen=True)
class Gap:
    """Auto against the better fixed mode at one concurrency: `best` is the fixed mode with the
    higher median tokens/s, `per_round` auto's tokens/s over best's in the same round, less 1
    (-0.02: 2% slower; a round's windows of one level run back to back, so a pair shares the
    host's state), `median` their median."""

    best: str
    per_round: tuple[float, ...]
    pooled: float | None = None  # auto over best pooled over the rounds (`pooled`), less 1

    @property
    def median(self) -> float:
        return _median(self.per_round)


def _paired(runs_a: Sequence[LevelResult], runs_b: Sequence[LevelResult]) -> tuple[float, ...]:
    b = {r.round: r.tokens_per_s for r in runs_b}
    return tuple(r.tokens_per_s / b[r.round] - 1 for r in runs_a if b.get(r.round))


def pooled(runs_a: Sequence[LevelResult], runs_b: Sequence[LevelResult]) -> float | None:
    """A's tokens over its seconds summed over the rounds, over B's: each mode's rate over every
    request its slices held. At one client a slice holds one or two requests, and how much a
    code edit gains depends on the edit (a rename is mostly copied, a docstring mostly new), so a
    round's pair can compare different edits; pooled, each mode's figure covers the workload's
    mix. None without tokens on both sides."""
    a_time = sum(r.wall_time for r in runs_a)
    b_time = sum(r.wall_time for r in runs_b)
    b_tokens = sum(r.num_completion_tokens for r in runs_b)
    if not a_time or not b_time or not b_tokens:
        return None
    return (sum(r.num_completion_tokens for r in runs_a) / a_time) / (b_tokens / b_time)


def auto_vs_best(levels: Sequence[LevelResult], workload: str = "mixed") -> dict[int, Gap]:
    """Per concurrency of `workload`, auto against the better of the fixed modes the run
    measured (off, always, or both). Levels without auto or a fixed mode are left out."""
    runs = {(m, c): rs for (m, w, c), rs in rounds_of(levels).items() if w == workload}
    out = {}
    for c in sorted({c for _, c in runs}):
        fixed = [m for m in FIXED_MODES if (m, c) in runs]
        if ("auto", c) in runs and fixed:
            best = max(fixed, key=lambda m: _median([r.tokens_per_s for r in runs[(m, c)]]))
            per_round = _paired(runs[("auto", c)], runs[(best, c)])
            if per_round:
                total = pooled(runs[("auto", c)], runs[(best, c)])
                out[c] = Gap(best, per_round, None if total is None else total - 1)
    return out


def check_targets(levels: Sequence[LevelResult]) -> dict[str, Any]:
    """The issue's targets, judged on the medians over the rounds; None where the run lacks the
    levels to judge."""
    gaps = auto_vs_best(levels)
    code = {m: rs for (m, w, c), rs in rounds_of(levels).items() if (w, c) == ("code_edit", 1)}
    both = "auto" in code and "off" in code
    ratios = _paired(code["auto"], code["off"]) if both else ()
    ratio = _median(ratios) + 1 if ratios else None
    return {
        "auto_vs_best": {c: gap.median for c, gap in gaps.items()},
        "auto_vs_best_per_round": {c: list(gap.per_round) for c, gap in gaps.items()},
        "auto_vs_best_pooled": {c: gap.pooled for c, gap in gaps.items()},
        "auto_within_tolerance": all(g.median >= -AUTO_TOLERANCE for g in gaps.values())
        if gaps
        else None,
        "code_edit_c1_auto_over_off": ratio,
        "code_edit_c1_per_round": [r + 1 for r in ratios],
        "code_edit_c1_pooled": pooled(code["auto"], code["off"]) if both else None,
        "code_edit_c1_target_met": None if ratio is None else ratio >= CODE_EDIT_TARGET,
    }


def report(levels: Sequence[LevelResult]) -> str:
    """A table per workload (in the order measured), auto against the best fixed mode per
    workload and concurrency (the mixed workload's lines unprefixed), then the targets."""
    workloads = list(dict.fromkeys(r.workload for r in levels)) or ["mixed"]
    parts = []
    for workload in workloads:
        rows = [r for r in levels if r.workload == workload]
        cs = sorted({r.concurrency for r in rows})
        title = TITLES.get(workload, workload) + (f", concurrency {cs[0]}" if len(cs) == 1 else "")
        parts += [f"{title}:", "", format_table(rows), ""]
    for workload in workloads:
        measured = {r.mode for r in levels if r.workload == workload}
        prefix = "" if workload == "mixed" else f"{workload} "
        fixed = ", ".join(m for m in FIXED_MODES if m in measured)
        for c, gap in auto_vs_best(levels, workload).items():
            rounds = ", ".join(f"{100 * g:+.1f}%" for g in gap.per_round)
            total = "" if gap.pooled is None else f", {100 * gap.pooled:+.1f}% pooled"
            parts.append(
                f"{prefix}c={c}: auto vs best({fixed}): {100 * gap.median:+.1f}% median{total} "
                f"(best: {gap.best}; per round: {rounds})"
            )
    targets = check_targets(levels)
    verdict = {True: "met", False: "NOT met", None: "not measured"}
    parts.append(
        f"target auto within {100 * AUTO_TOLERANCE:.0f}% of the best at every c: "
        f"{verdict[targets['auto_within_tolerance']]}"
    )
    ratio = targets["code_edit_c1_auto_over_off"]
    shown = "-" if ratio is None else f"{ratio:.2f}x"
    total = targets["code_edit_c1_pooled"]
    pooled_note = "" if total is None else f" (pooled over the rounds: {total:.2f}x)"
    parts.append(
        f"target code edit c=1 auto/off >= {CODE_EDIT_TARGET}: {shown}{pooled_note}, "
        f"{verdict[targets['code_edit_c1_target_met']]}"
    )
    return "\n".join(parts) + "\n"


def plot(levels: Sequence[LevelResult], path: Path, workloads: Sequence[str] = ("mixed",)) -> None:
    """Left: tokens/s against concurrency per mode; right: share of decisions speculating. One
    colour per mode, one line style per workload of `workloads` (the swept ones)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    swept = [r for r in combined(levels) if r.workload in workloads]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    colours = {m: f"C{i}" for i, m in enumerate(dict.fromkeys(r.mode for r in swept))}
    lines = ("-", "--", ":", "-.")
    for j, workload in enumerate(workloads):
        for mode, colour in colours.items():
            label = mode if len(workloads) == 1 else f"{mode}, {workload}"
            style = {"marker": "o", "label": label, "color": colour, "ls": lines[j % len(lines)]}
            rows = [r for r in swept if (r.mode, r.workload) == (mode, workload)]
            rows.sort(key=lambda r: r.concurrency)
            if not rows:
                continue
            left.plot([r.concurrency for r in rows], [r.tokens_per_s for r in rows], **style)
            shares = [(r.concurrency, r.speculating_share) for r in rows if mode != "off"]
            shares = [(x, 100 * s) for x, s in shares if s is not None]
            if shares:
                right.plot(*zip(*shares, strict=True), **style)
    ticks = sorted({r.concurrency for r in swept})
    for axis in (left, right):
        axis.set_xscale("log", base=2)
        axis.set_xticks(ticks, [str(c) for c in ticks])
        axis.set_xlabel("concurrent streaming clients")
        axis.grid(True, alpha=0.3)
        axis.legend()
    left.set_ylabel("total tokens/s")
    left.set_title("Throughput by speculation mode")
    right.set_ylabel("% of request-steps speculating")
    right.set_ylim(-5, 105)
    right.set_title("Share of requests speculating")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
