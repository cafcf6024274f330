"""bench/reliability/run.py's verdicts and summary table.

Each check is a dict {part, name, value, target, held, kind}: kind "correctness" for what must
always hold (gauges back to 0, the engine check, outputs equal to solo runs, no 5xx, no failed
requests), "target" for the figure the issue sets a goal for (RSS growth). The bench exits 1
when a correctness check fails.
"""

from __future__ import annotations

from typing import Any

RSS_GROWTH_TARGET_PCT = 5.0
MIN_FUZZ_CASES = 1500


def _check(part: str, name: str, value: Any, target: str, held: bool, kind: str = "correctness"):
    return {
        "part": part,
        "name": name,
        "value": value,
        "target": target,
        "held": held,
        "kind": kind,
    }


def _idle_checks(part: str, idle: Any) -> list[dict[str, Any]]:
    gauges = f"{idle.num_running:g} / {idle.num_waiting:g} / {idle.kv_cache_usage:g}"
    check = idle.check
    integrity = "ok" if check.get("ok") else f"FAILED: {check.get('error') or check}"
    return [
        _check(part, "running / waiting / KV usage after", gauges, "0 / 0 / 0", idle.is_idle),
        _check(part, "block manager integrity check", integrity, "ok", bool(check.get("ok"))),
    ]


def verdicts(results: Any) -> list[dict[str, Any]]:
    checks: list[dict[str, Any]] = []
    churn, soak, fuzz = results.churn, results.soak, results.fuzz
    if churn is not None:
        checks += [
            _check("churn", "requests failed", churn.num_errors, "0", churn.num_errors == 0),
            _check("churn", "preemptions", int(churn.num_preemptions), "> 0",
                   churn.num_preemptions > 0),
            *_idle_checks("churn", churn.idle),
            _check("churn", "completed outputs differing from solo",
                   f"{len(churn.mismatches)} of {churn.num_compared}", "0",
                   not churn.mismatches and churn.num_compared > 0),
        ]  # fmt: skip
    if soak is not None:
        checks += [
            _check("soak", "requests failed", soak.num_errors, "0", soak.num_errors == 0),
            _check("soak", "RSS growth", f"{soak.rss_growth_pct:+.2f}%",
                   f"< {RSS_GROWTH_TARGET_PCT:g}%", soak.rss_growth_pct < RSS_GROWTH_TARGET_PCT,
                   "target"),
            *_idle_checks("soak", soak.idle),
        ]  # fmt: skip
    if fuzz is not None:
        checks += [
            _check("fuzz", "cases", fuzz.num_cases, f">= {MIN_FUZZ_CASES}",
                   fuzz.num_cases >= MIN_FUZZ_CASES, "target"),
            _check("fuzz", "5xx responses", fuzz.num_5xx, "0", fuzz.num_5xx == 0),
            _check("fuzz", "no response / broken streams",
                   f"{fuzz.num_transport_errors} / {fuzz.num_broken_streams}", "0 / 0",
                   fuzz.num_transport_errors == fuzz.num_broken_streams == 0),
        ]  # fmt: skip
        if results.fuzz_idle is not None:
            checks += _idle_checks("fuzz", results.fuzz_idle)
    return checks


def churn_summary(churn: Any) -> str:
    return (
        f"{churn.num_requests} requests in {churn.seconds:.0f} s: {churn.num_completed} completed, "
        f"{churn.num_cancelled} cancelled ({churn.num_cancel_planned} planned), "
        f"{churn.num_errors} failed; {churn.num_preemptions:g} preemptions; "
        f"{len(churn.mismatches)} of {churn.num_compared} differ from their solo run "
        f"({churn.num_distinct_compared} distinct)"
    )


def soak_summary(soak: Any) -> str:
    return (
        f"{soak.seconds:.0f} s: {soak.num_completed} completed, {soak.num_cancelled} cancelled, "
        f"{soak.num_errors} failed; RSS {soak.rss_baseline_kib / 1024:.1f} MiB at "
        f"{soak.baseline_at_s:.0f} s -> {soak.rss_end_kib / 1024:.1f} MiB at the end "
        f"({soak.rss_growth_pct:+.2f}%)"
    )


def report(results: Any, checks: list[dict[str, Any]]) -> str:
    lines = []
    if results.churn is not None:
        lines.append(f"churn: {churn_summary(results.churn)}")
    if results.soak is not None:
        lines.append(f"soak: {soak_summary(results.soak)}")
    if results.fuzz is not None:
        f = results.fuzz
        lines.append(
            f"fuzz: {f.num_cases} cases in {f.seconds:.0f} s ({f.num_streamed} streamed 200s, "
            f"{f.num_cut_short} of them cut short by schemathesis), "
            f"statuses {f.statuses}"
        )
    lines += ["", "| part | check | value | target | held |", "|---|---|---|---|---|"]
    for c in checks:
        held = "yes" if c["held"] else ("NO" if c["kind"] == "correctness" else "no (target)")
        lines.append(f"| {c['part']} | {c['name']} | {c['value']} | {c['target']} | {held} |")
    for part in (results.churn, results.soak):
        for error in getattr(part, "errors", ()) or ():
            lines.append(f"error: {error}")
    if results.churn is not None:
        for m in results.churn.mismatches[:5]:
            lines.append(f"mismatch: {m}")
    if results.fuzz is not None:
        lines += [f"fuzz failure: {e}" for e in results.fuzz.examples]
    return "\n".join(lines) + "\n"
