"""bench/structured/run.py's checks and report, free of I/O and of the engine so tests can hold
them: an output against its schema, where two greedy outputs part, the per-mode figures and the
table.

`results` maps (case, mode) to one measurement: `token_ids`, `t_one` and `t_all` (seconds from
the request to its first token and to its end, in one run), `finish_reason`, the checks' fields
and the speculation counters.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import jsonschema

MODES = ("free", "grammar", "grammar_spec")
GRAMMAR_MODES = ("grammar", "grammar_spec")


def check_output(text: str, schema: dict[str, Any], finish_reason: str | None) -> dict[str, Any]:
    """Whether `text` parses as JSON and is valid against `schema`; an output cut by max_tokens
    is reported as truncated, not checked."""
    if finish_reason == "length":
        return {"is_truncated": True, "is_json": None, "is_valid": None, "error": None}
    try:
        value = json.loads(text)
    except ValueError as e:
        return {"is_truncated": False, "is_json": False, "is_valid": False, "error": str(e)}
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError as e:
        return {"is_truncated": False, "is_json": True, "is_valid": False, "error": e.message}
    return {"is_truncated": False, "is_json": True, "is_valid": True, "error": None}


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where two token sequences differ (the shorter one's length if one is a
    prefix of the other); None if they are equal."""
    if list(a) == list(b):
        return None
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def decode_figures(r: dict[str, Any]) -> tuple[int, float] | None:
    """(decode tokens, decode seconds) of one measurement: the tokens after the first and the
    time the full generation took beyond the 1-token one; None if there is nothing to time."""
    num_tokens, seconds = len(r["token_ids"]) - 1, r["t_all"] - r["t_one"]
    return (num_tokens, seconds) if num_tokens > 0 and seconds > 0 else None


def summarize(results: dict[tuple[str, str], dict[str, Any]], cases: Sequence[str]) -> dict:
    """Per mode, decode tokens/s over all cases (their tokens over their seconds) and ms per
    token; grammar_spec / grammar overall and per case; the grammar's ms per token over free;
    and the checks."""
    modes: dict[str, Any] = {}
    for mode in MODES:
        figures = [decode_figures(results[(c, mode)]) for c in cases]
        timed = [f for f in figures if f is not None]
        num_tokens, seconds = sum(f[0] for f in timed), sum(f[1] for f in timed)
        modes[mode] = {
            "num_decode_tokens": num_tokens,
            "decode_s": seconds,
            "tokens_per_s": num_tokens / seconds if seconds else None,
            "ms_per_token": 1e3 * seconds / num_tokens if num_tokens else None,
            "per_case_tokens_per_s": {
                c: (f[0] / f[1] if f else None) for c, f in zip(cases, figures, strict=True)
            },
        }
    grammar, spec, free = modes["grammar"], modes["grammar_spec"], modes["free"]
    per_case = {
        c: (s / g if s and g else None)
        for c, s, g in (
            (c, spec["per_case_tokens_per_s"][c], grammar["per_case_tokens_per_s"][c])
            for c in cases
        )
    }
    overhead = (
        grammar["ms_per_token"] - free["ms_per_token"]
        if grammar["ms_per_token"] and free["ms_per_token"]
        else None
    )
    checked = [results[(c, m)] for c in cases for m in GRAMMAR_MODES]
    finished = [r for r in checked if not r["is_truncated"]]
    return {
        "modes": modes,
        "spec_speedup": (
            spec["tokens_per_s"] / grammar["tokens_per_s"]
            if spec["tokens_per_s"] and grammar["tokens_per_s"]
            else None
        ),
        "spec_speedup_per_case": per_case,
        "grammar_ms_per_token": overhead,
        "grammar_overhead": overhead / free["ms_per_token"] if overhead is not None else None,
        "is_lossless": all(results[(c, "grammar_spec")]["first_divergence"] is None for c in cases),
        "num_grammar_outputs": len(checked),
        "num_truncated": len(checked) - len(finished),
        "num_valid": sum(bool(r["is_valid"]) for r in finished),
        "all_grammar_outputs_valid": all(r["is_valid"] for r in finished),
    }


def run_rows(results: dict[tuple[str, str], dict[str, Any]]) -> list[dict[str, Any]]:
    """The measurements as the JSON keeps them: a row per (case, mode), token ids counted."""
    return [
        {"case": c, "mode": m, "num_tokens": len(r["token_ids"])}
        | {k: v for k, v in r.items() if k != "token_ids"}
        for (c, m), r in results.items()
    ]


def _fmt(value: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def report(document: dict[str, Any]) -> str:
    """The table: a row per case and one for all, tokens/s per mode and the speedup; then the
    grammar's cost per token and the checks."""
    settings, summary = document["settings"], document["summary"]
    by_key = {(r["case"], r["mode"]): r for r in document["runs"]}
    modes = summary["modes"]
    lines = [
        f"{settings['model']} ({settings['dtype']}), batch 1, greedy, speculation "
        f"{settings['spec_mode']}: grammar + {settings['method']}, k = {settings['k']}",
        f"{'case':<12} {'tokens':>6} {'free':>7} {'grammar':>8} {'+spec':>7} {'speedup':>8} "
        f"{'accept':>7} {'same':>5} {'valid':>6}",
    ]
    for case in settings["cases"]:
        plain, spec = by_key[(case, "grammar")], by_key[(case, "grammar_spec")]
        tps = {m: modes[m]["per_case_tokens_per_s"][case] for m in MODES}
        valid = (
            "cut"
            if plain["is_truncated"] or spec["is_truncated"]
            else ("yes" if plain["is_valid"] and spec["is_valid"] else "NO")
        )
        lines.append(
            f"{case:<12} {plain['num_tokens']:>6} {_fmt(tps['free']):>7} "
            f"{_fmt(tps['grammar']):>8} {_fmt(tps['grammar_spec']):>7} "
            f"{_fmt(summary['spec_speedup_per_case'][case], '.2f', 'x'):>8} "
            f"{spec['mean_acceptance_length']:>7.2f} "
            f"{'yes' if spec['first_divergence'] is None else spec['first_divergence']:>5} "
            f"{valid:>6}"
        )
    num_tokens = sum(by_key[(c, "grammar")]["num_tokens"] for c in settings["cases"])
    lines.append(
        f"{'all':<12} {num_tokens:>6} "
        + " ".join(
            f"{_fmt(modes[m]['tokens_per_s']):>{w}}" for m, w in zip(MODES, (7, 8, 7), strict=True)
        )
        + f" {_fmt(summary['spec_speedup'], '.2f', 'x'):>8}"
    )
    overhead = summary["grammar_overhead"]
    lines.append(
        f"grammar cost: {_fmt(summary['grammar_ms_per_token'], '+.2f')} ms/token over free "
        f"({_fmt(None if overhead is None else 100 * overhead, '+.1f', '%')}; free "
        f"{_fmt(modes['free']['ms_per_token'])} ms/token)"
    )
    lines.append(
        f"grammar_spec = grammar token for token: {'yes' if summary['is_lossless'] else 'NO'}; "
        f"valid JSON: {summary['num_valid']} of {summary['num_grammar_outputs']} "
        f"({summary['num_truncated']} cut by max_tokens)"
    )
    return "\n".join(lines)
