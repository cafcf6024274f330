"""What one run of bench/policy/run.py measures: its flags, parsed and resolved into
BenchSettings (the clients of bench/policy/clients.py read them too)."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from bench.policy.workload import WORKLOADS

ROOT = Path(__file__).resolve().parents[2]

# --smoke: a minute on SmolLM2-135M, its own result files beside the full run's
SMOKE = {
    "config": "configs/smollm2-cpu.yaml",
    "speculative_config": {"method": "ngram", "num_speculative_tokens": 5},
    "concurrency": [1, 2],
    "duration": 5.0,
    "slice": 4.0,
    "rounds": 1,
    "max_tokens": 16,
    "out": "bench/results/policy-smoke.json",
    "plot": "bench/results/policy-smoke.png",
}


@dataclasses.dataclass(frozen=True)
class BenchSettings:
    """What one run measures, resolved from the flags."""

    config: dict[str, Any]
    modes: tuple[str, ...]
    concurrency: tuple[int, ...]
    duration: float  # seconds each level holds its concurrency
    max_tokens: int
    is_code_edit_c1: bool
    burst_gap: float
    startup_timeout: float
    kv_cache_memory: int | None = None  # bytes per server; None: the config's
    rounds: int = 1  # windows per (mode, level), interleaved with the other modes'
    is_cold: bool = False  # empty the prefix cache before each window
    slice: float = 0.0  # > 0: the modes take turns in slices this long under one load
    workloads: tuple[str, ...] = ("mixed",)  # each measured at every concurrency
    length_spread: float = 0.0  # request n's max_tokens: max_tokens * (1 +- this)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def _workloads(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown workload(s) {', '.join(unknown) or '(none given)'}; "
            f"choose from {', '.join(WORKLOADS)}"
        )
    return names


def parse_args(argv: Sequence[str] | None = None) -> tuple[BenchSettings, argparse.Namespace]:
    parser = argparse.ArgumentParser(
        prog="python -m bench.policy",
        description="The speculation policy over HTTP: modes off / always / auto side by side in "
        "one run (bench/policy/run.py).",
    )
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--modes", default="off,always,auto")
    parser.add_argument("--concurrency", type=_ints, default=(1, 2, 4, 8, 16, 32))
    parser.add_argument(
        "--workloads",
        type=_workloads,
        default=("mixed",),
        help=f"comma list of {', '.join(WORKLOADS)}; each is measured at every concurrency",
    )
    parser.add_argument(
        "--duration",
        type=float,
        default=20.0,
        help="with --slice 0: seconds each window holds its concurrency (c / 8 times that past "
        "c = 8)",
    )
    parser.add_argument(
        "--rounds", type=int, default=6, help="slices (or windows) per mode and level, in turns"
    )
    parser.add_argument(
        "--slice",
        type=float,
        default=10.0,
        help="the modes take turns in slices of this many seconds (c / 8 times that past "
        "c = 8) under one continuous load; 0: a window per mode and round instead",
    )
    parser.add_argument(
        "--prefix-cache",
        choices=("warm", "cold"),
        default="warm",
        help="warm: every prompt cached before the windows; cold: emptied before each window",
    )
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument(
        "--length-spread",
        type=float,
        default=0.5,
        help="requests ask for max_tokens * (1 - s .. 1 + s) tokens, spread evenly and the same "
        "in every mode, so c clients do not start and end their requests in step (0: all alike)",
    )
    parser.add_argument(
        "--code-edit-c1",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also a code-edit-only level at concurrency 1 per mode (default: on)",
    )
    parser.add_argument("--burst-gap-ms", type=float, default=5.0, help="tokens of one step")
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument(
        "--kv-cache-gib", type=float, default=1.0, help="KV cache per server (0: the config's)"
    )
    parser.add_argument("--out", default="bench/results/policy.json")
    parser.add_argument("--plot", default="docs/policy.png")
    parser.add_argument("--smoke", action="store_true", help="SmolLM2-135M, n-gram, c=1,2")
    args = parser.parse_args(argv)
    if args.slice > 0 and args.prefix_cache == "cold":
        parser.error("--prefix-cache cold empties the cache between windows: it needs --slice 0")
    config_path = SMOKE["config"] if args.smoke else args.config
    config = yaml.safe_load((ROOT / config_path).read_text())
    if args.smoke:
        config["engine"]["speculative_config"] = SMOKE["speculative_config"]
        args.concurrency = tuple(SMOKE["concurrency"])
        args.duration, args.max_tokens = SMOKE["duration"], SMOKE["max_tokens"]
        args.rounds, args.slice = SMOKE["rounds"], SMOKE["slice"]
        args.out, args.plot = SMOKE["out"], SMOKE["plot"]
    settings = BenchSettings(
        config=config,
        modes=tuple(args.modes.split(",")),
        concurrency=tuple(args.concurrency),
        duration=args.duration,
        max_tokens=args.max_tokens,
        is_code_edit_c1=args.code_edit_c1,
        burst_gap=args.burst_gap_ms / 1000,
        startup_timeout=args.startup_timeout,
        kv_cache_memory=int(args.kv_cache_gib * 2**30) if args.kv_cache_gib > 0 else None,
        rounds=max(1, args.rounds),
        is_cold=args.prefix_cache == "cold",
        slice=max(0.0, args.slice),
        workloads=tuple(args.workloads),
        length_spread=min(max(0.0, args.length_spread), 0.9),
    )
    return settings, args
