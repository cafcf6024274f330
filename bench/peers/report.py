"""bench/peers/run.py's report: the markdown table (one column per engine, a row per figure), the
ratios of specserve's columns to each peer's, and the machine and versions the JSON records.
Pure formatting over the results dict, apart from reading the CPU model and package versions."""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.peers import setup
from bench.peers.install import PeerPaths, peer_versions

FAMILIES = ("code_edit", "copy", "open_chat")  # the batch-1 prompt families, in column order

Value = float | None | tuple[float | None, ...]


def table_rows(
    server_results: dict[str, Any], concurrency: Sequence[int]
) -> list[tuple[str, Value, int]]:
    """(row label, value, decimals) of one engine's column, from its servers' results; a figure
    its run lacks is None."""
    off = server_results.get("off", {})

    def fam(spec: str) -> tuple[float | None, ...]:
        families = server_results.get(spec, {}).get("families", {})
        return tuple(families.get(f) for f in FAMILIES)

    streams = off.get("streams", {})
    return [
        ("batch-1 decode", off.get("decode_tps"), 1),
        ("TTFT batch 1 (ms)", off.get("ttft_ms"), 0),
        *((f"{c} streams", streams.get(str(c)), 1) for c in concurrency),
        ("spec off (code edit / copy / open chat)", fam("off"), 1),
        ("draft model (code edit / copy / open chat)", fam("draft_model"), 1),
        ("n-gram (code edit / copy / open chat)", fam("ngram"), 1),
        ("RSS at ready, spec off (GiB)", off.get("ready_rss_gib"), 2),
        ("peak RSS, spec off (GiB)", off.get("peak_rss_gib"), 2),
    ]


def fmt(value: Value, decimals: int) -> str:
    if isinstance(value, tuple):
        return " / ".join(fmt(v, decimals) for v in value)
    return "-" if value is None else f"{value:.{decimals}f}"


def _ratio(ours: Value, theirs: Value) -> str:
    if isinstance(ours, tuple) and isinstance(theirs, tuple):
        return " / ".join(_ratio(a, b) for a, b in zip(ours, theirs, strict=True))
    if not isinstance(ours, float | int) or not isinstance(theirs, float | int) or not theirs:
        return "-"
    return f"{ours / theirs:.2f}x"


def format_report(engines: dict[str, Any], concurrency: Sequence[int]) -> str:
    """The figures, one column per engine in setup.ENGINES order, then each of specserve's
    columns (bf16, GGUF) / each peer."""
    names = [n for n in setup.ENGINES if n in engines]
    columns = {n: table_rows(engines[n]["servers"], concurrency) for n in names}
    labels = [label for label, _, _ in columns[names[0]]] if names else []
    header = "| figure (tokens/s) | " + " | ".join(setup.ENGINES[n].label for n in names) + " |"
    lines = [header, "|---|" + "---:|" * len(names)]
    for i, label in enumerate(labels):
        cells = [fmt(columns[n][i][1], columns[n][i][2]) for n in names]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    peers = [n for n in names if not n.startswith("specserve")]
    ours_names = [n for n in names if n.startswith("specserve")]
    for our in ours_names if peers else ():
        lines += [
            "",
            f"| {setup.ENGINES[our].label} / peer | "
            + " | ".join(setup.ENGINES[n].label for n in peers)
            + " |",
        ]
        lines.append("|---|" + "---:|" * len(peers))
        for i, label in enumerate(labels):
            ours = columns[our][i][1]
            cells = [_ratio(ours, columns[n][i][1]) for n in peers]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    if ours_names and peers:
        lines.append("")
        lines.append("Ratios above 1 favour specserve, except TTFT and RSS (lower is better).")
    failed = [
        f"{n} {s}: {r['failed'][:200]}"
        for n in names
        for s, r in engines[n]["servers"].items()
        if "failed" in r
    ]
    lines += ["", *(f"FAILED {line}" for line in failed)] if failed else []
    return "\n".join(lines) + "\n"


def machine_info(peers_dir: Path) -> dict[str, Any]:
    """The CPU, the repo's torch and specserve, and the installed peers' versions."""
    cpu = platform.processor()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "cpu": cpu,
        "num_cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": importlib.metadata.version("torch"),
        "specserve": importlib.metadata.version("specserve"),
        "peers": peer_versions(PeerPaths(peers_dir)),
    }
