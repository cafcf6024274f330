"""The server's Prometheus counters as bench/policy/run.py reads them: the text exposition
parsed, the policy's decisions and each speculation mode's tokens and seconds, and the share of
decisions that speculated between two scrapes."""

from __future__ import annotations

import re
from collections.abc import Mapping

_SAMPLE = re.compile(r"^([A-Za-z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus text exposition: series name -> [(labels, value)]; comments skipped."""
    series: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None or line.startswith("#"):
            continue
        name, labels, value = match.groups()
        series.setdefault(name, []).append((dict(_LABEL.findall(labels or "")), float(value)))
    return series


DECISIONS = "specserve:spec_decode_policy_decisions_total"
MODE_TOKENS = "specserve:spec_decode_mode_generation_tokens_total"
MODE_SECONDS = "specserve:spec_decode_mode_seconds_total"


def decision_counts(metrics: Mapping[str, list[tuple[dict[str, str], float]]]) -> dict[str, float]:
    """Policy decisions by decision ("speculate", "skip"), summed over reasons; empty when the
    server does not export them."""
    counts: dict[str, float] = {}
    for labels, value in metrics.get(DECISIONS, []):
        decision = labels.get("decision", "")
        counts[decision] = counts.get(decision, 0.0) + value
    return counts


def mode_counters(
    metrics: Mapping[str, list[tuple[dict[str, str], float]]],
) -> dict[str, tuple[float, float]]:
    """Per speculation mode, the (generation tokens, seconds) of the engine steps decided in it;
    empty when the server does not export them."""
    tokens = {labels.get("mode", ""): v for labels, v in metrics.get(MODE_TOKENS, [])}
    seconds = {labels.get("mode", ""): v for labels, v in metrics.get(MODE_SECONDS, [])}
    return {mode: (tokens[mode], seconds.get(mode, 0.0)) for mode in tokens}


def speculating_share(before: Mapping[str, float], after: Mapping[str, float]) -> float | None:
    """Share of per-request decisions between two scrapes that speculated; None when the
    counters are absent or nothing was decided."""
    if not after:
        return None
    speculate = after.get("speculate", 0.0) - before.get("speculate", 0.0)
    skip = after.get("skip", 0.0) - before.get("skip", 0.0)
    total = speculate + skip
    return speculate / total if total > 0 else None
