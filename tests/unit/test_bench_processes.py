"""bench/common/processes.py's in_checkout: a function of this checkout's bench package run in a
subprocess whose engine package is another checkout's."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from bench.common.processes import host_cpu, in_checkout

ROOT = Path(__file__).resolve().parents[2]
CPUINFO = "model name\t: Some CPU\nflags\t\t: fpu avx2 avx512f\n"


def test_in_checkout_runs_this_checkouts_bench_function_against_this_checkout():
    assert in_checkout(ROOT, "bench.common.processes", "host_cpu", CPUINFO) == host_cpu(CPUINFO)


def test_in_checkout_takes_the_engine_of_the_other_checkout_and_the_bench_of_this_one(tmp_path):
    # The other checkout's engine fails on import, so the timed function fails where it imports
    # it; its bench would fail at once, before the function is even looked up.
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "__init__.py").write_text('raise ImportError("the other engine")\n')
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "__init__.py").write_text('raise ImportError("the other bench")\n')
    with pytest.raises(subprocess.CalledProcessError) as failed:
        in_checkout(tmp_path, "bench.policy.cost", "time_sizes", [8], 1)
    assert "the other engine" in failed.value.stderr
    assert "the other bench" not in failed.value.stderr
