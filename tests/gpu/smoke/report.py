"""The smoke bench's JSON read back: one markdown table, and what in it fails the node."""

from __future__ import annotations

from typing import Any

COLUMNS = (
    "graphs",
    "batch-invariant",
    "mode",
    "c",
    "tok/s",
    "forward GB/s",
    "host ms/step",
    "overlap",
    "TTFT p50 ms",
    "TTFT p95 ms",
    "graph share",
    "draft graph share",
    "acceptance",
    "KV blocks",
    "peak / budget GiB",
)


def markdown_table(bench: dict[str, Any]) -> str:
    """One row per point, engine facts (backend, KV blocks, budget) repeated on its rows."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for engine in bench.get("engines", []):
        facts = engine["engine"]
        for p in engine["points"]:
            cells = (
                "on" if p["graphs"] else "off",
                "on" if p.get("batch_invariant") else "off",
                _mode(p["mode"], facts.get("speculation")),
                p["concurrency"],
                f"{p['tokens_per_s']:.0f}",
                _number(_steps(p, "forward_gb_per_s"), ".0f"),
                _number(_steps(p, "rest_ms"), ".2f"),
                _number(_steps(p, "overlap_share"), ".2f"),
                _number(p["ttft_p50_ms"], ".1f"),
                _number(p["ttft_p95_ms"], ".1f"),
                _number(p["graph_share"], ".2f"),
                _number(p["draft_graph_share"], ".2f"),
                _number(p["acceptance"], ".2f"),
                facts["num_kv_blocks"],
                _memory(p["peak_memory_bytes"], facts["memory_budget_bytes"]),
            )
            lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    backends = sorted({e["engine"]["attention_backend"] for e in bench.get("engines", [])})
    lines.append(f"\nattention {', '.join(backends) or 'none'}; {_model_line(bench)}")
    return "\n".join(lines)


def _steps(point: dict[str, Any], field: str) -> float | None:
    """A point's step-breakdown figure over its steps without drafts (the off mode's all), else
    over those with drafts: the forward's achieved bandwidth, the host's rest of a step."""
    steps = point.get("steps") or {}
    for key in ("without_drafts", "with_drafts"):
        value = (steps.get(key) or {}).get(field)
        if value is not None:
            return value
    return None


def bench_failures(bench: dict[str, Any]) -> list[str]:
    """What fails the node in the bench: an error, a point that generated nothing, graphs that
    never replayed where they were captured, a peak past the engine's memory budget (over a
    point, or over the engine's life from loading on, capture included)."""
    failures = []
    if "error" in bench:
        failures.append("the bench raised: " + bench["error"].strip().splitlines()[-1])
    for engine in bench.get("engines", []):
        facts = engine["engine"]
        budget = facts["memory_budget_bytes"]
        graphs = f"graphs {'on' if facts['graphs'] else 'off'}"
        if facts.get("batch_invariant"):
            graphs += ", batch-invariant"
        failures += _over_budget(graphs, facts.get("peak_memory_bytes"), budget)
        for p in engine["points"]:
            where = f"{graphs}, {p['mode']}, c={p['concurrency']}"
            if p["num_tokens"] == 0:
                failures.append(f"{where}: no token generated")
            if facts["num_graph_buckets"] and p["graph_share"] == 0:
                failures.append(f"{where}: graphs captured, none replayed")
            failures += _over_budget(where, p["peak_memory_bytes"], budget)
    return failures


def _over_budget(where: str, peak: int | None, budget: int | None) -> list[str]:
    if peak is None or budget is None or peak <= budget:
        return []
    return [f"{where}: peak memory past the budget ({_memory(peak, budget)} GiB)"]


def _mode(mode: str, method: str | None) -> str:
    """ "auto", or "always (eagle3)" where the engine's proposer is worth naming."""
    return f"{mode} ({method})" if mode != "off" and method else mode


def _number(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _memory(peak: int | None, budget: int | None) -> str:
    if peak is None:
        return "-"
    return f"{peak / 2**30:.1f} / {'-' if budget is None else f'{budget / 2**30:.1f}'}"


def _model_line(bench: dict[str, Any]) -> str:
    model = bench.get("model")
    if not model:
        return "no model"
    shape = model["shape"]
    return (
        f"{model['name']}, random weights (seed {model['seed']}): hidden {shape['hidden_size']}, "
        f"{shape['num_hidden_layers']} layers, {shape['num_attention_heads']}/"
        f"{shape['num_key_value_heads']} heads, vocab {shape['vocab_size']}; draft = its first "
        f"{model['draft_layers']} layer(s)"
    )
