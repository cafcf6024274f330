"""bench/policy.py's report: the markdown tables per workload (tokens/s relative to off, TTFT,
inter-token latency, share speculating), auto against the better fixed mode at each concurrency,
the verdict on the targets, and the PNG plot. It reads finished LevelResults only; the run
itself (servers, clients) stays in bench/policy.py."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from policy_workload import LevelResult

AUTO_TOLERANCE = 0.03  # auto may trail the better fixed mode by this much
CODE_EDIT_TARGET = 1.5  # auto over off, code edit at concurrency 1


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def format_table(levels: Sequence[LevelResult]) -> str:
    """Markdown: one row per (concurrency, mode) of one workload, tokens/s relative to off."""
    base = {(r.workload, r.concurrency): r.tokens_per_s for r in levels if r.mode == "off"}
    lines = [
        "| c | mode | tok/s | vs off | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms "
        "| % speculating | errors |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    order = {"off": 0, "always": 1, "auto": 2}
    for r in sorted(levels, key=lambda r: (r.concurrency, order.get(r.mode, len(order)))):
        off = base.get((r.workload, r.concurrency))
        ratio = f"{r.tokens_per_s / off:.2f}x" if off else "-"
        share = "-" if r.speculating_share is None else f"{100 * r.speculating_share:.0f}%"
        lines.append(
            f"| {r.concurrency} | {r.mode} | {r.tokens_per_s:.2f} | {ratio} | {_ms(r.ttft_p50)} "
            f"| {_ms(r.ttft_p99)} | {_ms(r.itl_p50)} | {_ms(r.itl_p99)} | {share} "
            f"| {r.num_errors} |"
        )
    return "\n".join(lines)


def auto_vs_best(levels: Sequence[LevelResult]) -> dict[int, tuple[float, str]]:
    """Per concurrency of the mixed workload: auto's tokens/s relative to the better of off and
    always (-0.02 = 2% slower), and which one that was. Levels missing a mode are left out."""
    tps = {(r.mode, r.concurrency): r.tokens_per_s for r in levels if r.workload == "mixed"}
    out = {}
    for c in sorted({c for _, c in tps}):
        if all((m, c) in tps for m in ("off", "always", "auto")):
            best = max(("off", "always"), key=lambda m: tps[(m, c)])
            out[c] = (tps[("auto", c)] / tps[(best, c)] - 1, best)
    return out


def check_targets(levels: Sequence[LevelResult]) -> dict[str, Any]:
    """The issue's targets; None where the run lacks the levels to judge."""
    gaps = auto_vs_best(levels)
    code = {r.mode: r.tokens_per_s for r in levels if r.workload == "code_edit"}
    ratio = code["auto"] / code["off"] if "auto" in code and code.get("off") else None
    return {
        "auto_vs_best": {c: gap for c, (gap, _) in gaps.items()},
        "auto_within_tolerance": all(g >= -AUTO_TOLERANCE for g, _ in gaps.values())
        if gaps
        else None,
        "code_edit_c1_auto_over_off": ratio,
        "code_edit_c1_target_met": None if ratio is None else ratio >= CODE_EDIT_TARGET,
    }


def report(levels: Sequence[LevelResult]) -> str:
    mixed = [r for r in levels if r.workload == "mixed"]
    code = [r for r in levels if r.workload == "code_edit"]
    parts = ["Mixed workload (code edit + open chat):", "", format_table(mixed)]
    if code:
        parts += ["", "Code edit only, concurrency 1:", "", format_table(code)]
    parts.append("")
    for c, (gap, best) in auto_vs_best(levels).items():
        parts.append(f"c={c}: auto vs best(off, always): {100 * gap:+.1f}% (best: {best})")
    targets = check_targets(levels)
    verdict = {True: "met", False: "NOT met", None: "not measured"}
    parts.append(
        f"target auto within {100 * AUTO_TOLERANCE:.0f}% of the best at every c: "
        f"{verdict[targets['auto_within_tolerance']]}"
    )
    ratio = targets["code_edit_c1_auto_over_off"]
    shown = "-" if ratio is None else f"{ratio:.2f}x"
    parts.append(
        f"target code edit c=1 auto/off >= {CODE_EDIT_TARGET}: {shown}, "
        f"{verdict[targets['code_edit_c1_target_met']]}"
    )
    return "\n".join(parts) + "\n"


def plot(levels: Sequence[LevelResult], path: Path) -> None:
    """Left: tokens/s against concurrency per mode; right: share of decisions speculating."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mixed = [r for r in levels if r.workload == "mixed"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, mode in enumerate(dict.fromkeys(r.mode for r in mixed)):
        style = {"marker": "o", "label": mode, "color": f"C{i}"}  # one colour per mode
        rows = sorted((r for r in mixed if r.mode == mode), key=lambda r: r.concurrency)
        left.plot([r.concurrency for r in rows], [r.tokens_per_s for r in rows], **style)
        shares = [(r.concurrency, r.speculating_share) for r in rows if mode != "off"]
        shares = [(x, 100 * s) for x, s in shares if s is not None]
        if shares:
            right.plot(*zip(*shares, strict=True), **style)
    ticks = sorted({r.concurrency for r in mixed})
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
