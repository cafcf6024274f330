"""Summarise a step trace (SPECSERVE_STEP_TRACE, engine/telemetry/step_trace.py) per policy mode.

Per mode: steps, their seconds and the generation tokens they added (tokens/s as the policy
bench's slices count it), the mean step split into forward, proposing and the rest, the mean
query tokens, logits rows and scheduled requests per step, the share of steps in which some
request drafted, the draft model's catch-up tokens, the decision reasons, and per kind of step
(decode-only, drafting, with a prompt chunk) its share of the time and its tokens/s. Then the steps
that decode only (one query token per scheduled request, no drafts), by batch size, per mode:
the same step shape in each mode, so a difference there is the mode's cost outside the shape.
Last, the runs of one mode in turn (a sliced bench's slices: consecutive steps of one mode,
a gap of over --gap seconds also ending one): each run's tokens/s beside the median forward of its
decode-only steps at the run's commonest batch size. A slice slow at the same step shape as its
neighbours was slowed by the host, not by its mode. Where the trace records the step-time model's
prediction: per mode and kind of step, forward over predicted; and auto's steps by the drafting
correction they were priced with, with the share that drafted.

    python -m bench.policy.step_trace /tmp/steps.jsonl [--since SECONDS] [--until SECONDS]
        [--gap 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from typing import Any


def load(path: str) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def seconds_of(steps: Iterable[dict[str, Any]]) -> float:
    """The steps' seconds: forward and verify, proposing and the rest (StepStats.seconds)."""
    return sum(s["forward"] + s["draft"] + s["overhead"] for s in steps)


def kind(step: dict[str, Any]) -> str:
    """decode (one query token per request, no drafts), drafting (decode rows and drafts) or
    prompt (some prompt chunk in it)."""
    if step["tokens"] > step["scheduled"] + step["draft_tokens"]:
        return "prompt"
    return "drafting" if step["drafting"] else "decode"


def by_mode(steps: Iterable[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each mode's totals and means over its steps."""
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for s in steps:
        groups[s["mode"]].append(s)
    out = {}
    for mode, group in sorted(groups.items()):
        n = len(group)
        seconds = seconds_of(group)
        generated = sum(s["generated"] for s in group)
        reasons: Counter[str] = Counter()
        for s in group:
            reasons.update(s["reasons"])
        out[mode] = {
            "steps": n,
            "seconds": seconds,
            "generated": generated,
            "tokens_per_s": generated / seconds if seconds else 0.0,
            "step_ms": 1e3 * seconds / n,
            "forward_ms": 1e3 * sum(s["forward"] for s in group) / n,
            "draft_ms": 1e3 * sum(s["draft"] for s in group) / n,
            "overhead_ms": 1e3 * sum(s["overhead"] for s in group) / n,
            "tokens": sum(s["tokens"] for s in group) / n,
            "rows": sum(s["rows"] for s in group) / n,
            "scheduled": sum(s["scheduled"] for s in group) / n,
            "drafting_steps": sum(1 for s in group if s["drafting"]) / n,
            "accepted_per_draft_token": (
                sum(s["accepted"] for s in group) / max(1, sum(s["draft_tokens"] for s in group))
            ),
            "catch_up": sum(s["catch_up"] for s in group),
            "reasons": dict(reasons.most_common()),
            "kinds": kinds(group, seconds),
        }
    return out


def kinds(steps: Sequence[dict[str, Any]], total: float) -> dict[str, dict[str, float]]:
    """Per kind of step: how many, their share of the seconds, their tokens/s."""
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for s in steps:
        groups[kind(s)].append(s)
    out = {}
    for name, group in sorted(groups.items()):
        seconds = seconds_of(group)
        out[name] = {
            "steps": len(group),
            "time_share": seconds / total if total else 0.0,
            "tokens_per_s": sum(s["generated"] for s in group) / seconds if seconds else 0.0,
        }
    return out


def decode_only(steps: Iterable[dict[str, Any]]) -> dict[int, dict[str, tuple[int, float]]]:
    """Steps that decode only, by batch size: per mode (count, median forward ms)."""
    groups: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for s in steps:
        if kind(s) == "decode":
            groups[s["scheduled"]][s["mode"]].append(1e3 * s["forward"])
    return {
        size: {m: (len(v), statistics.median(v)) for m, v in sorted(modes.items())}
        for size, modes in sorted(groups.items())
    }


def pricing(steps: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """How the policy priced the steps (traces that record `predicted`): per mode and kind of
    step, the median of forward over predicted forward; and per correction a step was priced
    with (to 0.05), its steps and the share of them that drafted: the policy drafts where the
    correction is low, so a share that follows it says the correction, not the model, decides."""
    ratios: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    corrections: dict[float, list[int]] = defaultdict(lambda: [0, 0])
    for s in steps:
        if s.get("predicted", 0.0) <= 0.0:
            continue
        ratios[s["mode"]][kind(s)].append(s["forward"] / s["predicted"])
        if s["mode"] == "auto" and s["decided"]:
            counts = corrections[round(20 * s["correction"]) / 20]
            counts[0] += 1
            counts[1] += bool(s["drafting"])
    return {
        "forward_over_predicted": {
            mode: {k: (len(v), statistics.median(v)) for k, v in sorted(per_kind.items())}
            for mode, per_kind in sorted(ratios.items())
        },
        "drafting_by_correction": {c: tuple(n) for c, n in sorted(corrections.items())},
    }


def runs(steps: Sequence[dict[str, Any]], gap: float = 3.0) -> list[dict[str, Any]]:
    """Consecutive steps of one mode (a gap of over `gap` seconds also ends a run): each run's
    start (seconds into the trace), mode, steps, tokens/s over its step seconds, mean scheduled
    requests, and its decode-only steps at its commonest batch size (count, median forward ms)."""
    groups: list[list[dict[str, Any]]] = []
    for s in steps:
        if groups and s["mode"] == groups[-1][-1]["mode"] and s["t"] - groups[-1][-1]["t"] <= gap:
            groups[-1].append(s)
        else:
            groups.append([s])
    out = []
    for group in groups:
        seconds = seconds_of(group)
        size = Counter(s["scheduled"] for s in group).most_common(1)[0][0]
        decode = [
            1e3 * s["forward"] for s in group if kind(s) == "decode" and s["scheduled"] == size
        ]
        out.append(
            {
                "start": group[0]["t"] - steps[0]["t"],
                "mode": group[0]["mode"],
                "steps": len(group),
                "tokens_per_s": sum(s["generated"] for s in group) / seconds if seconds else 0.0,
                "scheduled": sum(s["scheduled"] for s in group) / len(group),
                "batch": size,
                "decode_steps": len(decode),
                "decode_forward_ms": statistics.median(decode) if decode else None,
            }
        )
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.policy.step_trace", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("trace")
    parser.add_argument(
        "--since", type=float, default=0.0, help="skip the trace's first SECONDS (start-up)"
    )
    parser.add_argument("--gap", type=float, default=3.0, help="seconds that end a run")
    parser.add_argument("--min-steps", type=int, default=20, help="runs shorter are not shown")
    parser.add_argument("--until", type=float, help="and its steps after SECONDS")
    parser.add_argument("--json", help="write the summary as JSON here")
    args = parser.parse_args(argv)
    steps = load(args.trace)
    if not steps:
        sys.exit(f"{args.trace}: no steps")
    start = steps[0]["t"]
    until = math.inf if args.until is None else args.until
    steps = [s for s in steps if args.since <= s["t"] - start <= until]
    modes = by_mode(steps)
    keys = ["steps", "tokens_per_s", "step_ms", "forward_ms", "draft_ms", "overhead_ms"]
    keys += ["tokens", "rows", "scheduled", "drafting_steps", "catch_up"]
    print("| mode | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for mode, m in modes.items():
        cells = [f"{m[k]:.3g}" if isinstance(m[k], float) else str(m[k]) for k in keys]
        print(f"| {mode} | " + " | ".join(cells) + " |")
    for mode, m in modes.items():
        print(f"{mode} reasons: {m['reasons']}")
        for name, k in m["kinds"].items():
            print(
                f"  {name} steps: {k['steps']}, {100 * k['time_share']:.0f}% of the time, "
                f"{k['tokens_per_s']:.1f} tokens/s"
            )
    sizes = decode_only(steps)
    print("\ndecode-only steps, forward ms (median) by batch size:")
    for size, per_mode in sizes.items():
        cells = ", ".join(f"{m} {ms:.1f} ({n})" for m, (n, ms) in per_mode.items())
        print(f"  {size:3d}: {cells}")
    priced = pricing(steps)
    if priced["forward_over_predicted"]:
        print("\nforward over the step-time model's prediction (median), by kind of step:")
        for mode, per_kind in priced["forward_over_predicted"].items():
            cells = ", ".join(f"{k} {r:.3f} ({n})" for k, (n, r) in per_kind.items())
            print(f"  {mode}: {cells}")
        print("auto's steps by the correction they were priced with: steps, share drafting:")
        for c, (n, drafted) in priced["drafting_by_correction"].items():
            print(f"  {c:.2f}: {n}, {drafted / n:.2f}")
    turns = [r for r in runs(steps, args.gap) if r["steps"] >= args.min_steps]
    print("\nruns of one mode: start s, mode, steps, tokens/s, batch, decode-only forward ms:")
    for r in turns:
        forward = r["decode_forward_ms"]
        print(
            f"  {r['start']:7.0f} {r['mode']:>6} {r['steps']:5d} {r['tokens_per_s']:6.1f}"
            f" {r['batch']:3d} " + (f"{forward:6.0f} ({r['decode_steps']})" if forward else "-")
        )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            summary = {"modes": modes, "decode_only": sizes, "pricing": priced, "runs": turns}
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
