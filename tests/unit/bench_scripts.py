"""Importing the scripts under bench/ for their tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load_bench_script(filename: str, *companions: str) -> tuple[ModuleType, ...]:
    """bench/<filename> as a module, then the bench/ modules named in `companions` that it
    imported. bench/ leaves sys.path afterwards, so its other scripts (spec.py...) cannot shadow
    modules of the same name."""
    sys.path.insert(0, str(BENCH))
    try:
        name = "bench_" + Path(filename).stem
        spec = importlib.util.spec_from_file_location(name, BENCH / filename)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    finally:
        while str(BENCH) in sys.path:
            sys.path.remove(str(BENCH))
    return (module, *(sys.modules[c] for c in companions))


def load_reliability() -> tuple[ModuleType, ...]:
    """bench/reliability.py and its parts: (reliability, workload, server, fuzz, report)."""
    parts = ("workload", "server", "fuzz", "report")
    return load_bench_script("reliability.py", *(f"reliability_{part}" for part in parts))
