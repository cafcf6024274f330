"""Child processes for the benches that drive a real server (bench/policy/run.py,
bench/reliability/run.py, deploy/grafana/render_dashboard.py): a free port, a process stopped on
the way out, a wait until it answers, and `specserve serve` on a config; a bench function run on
another checkout's engine (bench/policy/cost.py, bench/policy/host_time.py, bench/attention.py:
two versions side by side, `side_by_side`)
and that checkout's commit; and the host's CPU, which a result file names."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
# Run by in_checkout: this checkout's bench package (argv[1], its directory) bound as `bench`
# before anything else, the other checkout (argv[2]) first on sys.path for `engine`, then function
# argv[4] of module argv[3] called on the JSON list argv[5], its result printed as JSON.
_CALL = """
import importlib, importlib.util, json, sys
bench, root, module, function, args = sys.argv[1:]
spec = importlib.util.spec_from_file_location(
    "bench", bench + "/__init__.py", submodule_search_locations=[bench]
)
sys.modules["bench"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sys.modules["bench"])
sys.path.insert(0, root)
print(json.dumps(getattr(importlib.import_module(module), function)(*json.loads(args))))
"""


def in_checkout(root: Path, module: str, function: str, *args: Any) -> Any:
    """`function(*args)` of this checkout's bench module `module` (a dotted name such as
    "bench.attention"; JSON in, JSON out) in a subprocess whose `engine` package is `root`'s:
    this checkout's bench code timing another checkout's engine.

    `root` first on the child's sys.path would import `root`'s bench package too, so the child
    binds this checkout's bench package first (its modules are then looked up in its directory
    alone) and only then puts `root` first for `engine`. Both keep their real paths, so the CPU
    kernels' build of each checkout is the one its own runs use (a build names its sources by
    path). Against a checkout older than this engine layout the timed function's engine imports
    do not resolve."""
    command = [sys.executable, "-c", _CALL, str(BENCH), str(Path(root).resolve()), module]
    command += [function, json.dumps(args)]
    # Where engine and bench come from is decided above, not by the caller's PYTHONPATH.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(command, check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def side_by_side(
    against: Path | None,
    rounds: int,
    module: str,
    function: str,
    args: tuple[Any, ...],
    line: Callable[[Any], str],
) -> tuple[dict[str, Path], dict[str, list[Any]]]:
    """`function(*args)` of bench module `module`, timed in this checkout ("this") and, when
    `against` names another checkout, in that one ("against"), round by round alternating so
    both see the same host state; each result printed as `line` makes it. Returns the roots and
    each one's results in round order."""
    roots = {"this": ROOT} | ({"against": against.resolve()} if against else {})
    results: dict[str, list[Any]] = {name: [] for name in roots}
    for r in range(rounds):
        for name, root in roots.items():
            results[name].append(in_checkout(root, module, function, *args))
            print(f"round {r + 1} {name}: {line(results[name][-1])}", flush=True)
    return roots, results


def write_result(out: Path, result: dict[str, Any]) -> None:
    """A bench's result as indented JSON in `out` (its folder made), and on stdout."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


def commit_of(root: Path) -> str:
    """The short commit a checkout is at ("unknown" outside git)."""
    run = subprocess.run(
        ["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return run.stdout.strip() or "unknown"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running(
    command: list[str], log_path: Path, stop_timeout: float = 60.0
) -> Iterator[subprocess.Popen[bytes]]:
    """Run `command` from the repository root with its output in `log_path`; on the way out
    SIGTERM it, and SIGKILL it if it has not exited after `stop_timeout` seconds."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=stop_timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def wait_ready(url: str, proc: subprocess.Popen[bytes], log_path: Path, timeout: float) -> None:
    """Poll `url` until it answers 200; fail early, with the log's tail, if the process exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-4000:]
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}:\n{tail}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=5).status_code == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready after {timeout:.0f} s (log: {log_path})")


@contextlib.contextmanager
def serving(
    config: dict[str, Any], startup_timeout: float, prefix: str = "specserve-bench-"
) -> Iterator[tuple[str, subprocess.Popen[bytes], Path]]:
    """`specserve serve` on `config` (a config file's dict) on a free port: its base URL, process
    and log path once /health is 200; stopped on the way out. The config and log live in a
    temporary directory named with `prefix`."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        config_path, log_path = Path(tmp) / "config.yaml", Path(tmp) / "server.log"
        config_path.write_text(yaml.safe_dump(config))
        port = free_port()
        command = [sys.executable, "-m", "server.cli", "serve", "--config", str(config_path)]
        command += ["--port", str(port), "--log-level", "warning"]
        with running(command, log_path) as proc:
            url = f"http://127.0.0.1:{port}"
            wait_ready(f"{url}/health", proc, log_path, startup_timeout)
            yield url, proc, log_path


def host_cpu(cpuinfo: str) -> dict[str, Any]:
    """The CPU's model name and whether it has AVX2, AVX-512F and AVX-512 VNNI (the CPU kernels'
    forms), from the text of /proc/cpuinfo: the first processor's flags."""
    model, flags = None, ""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and model is None:
            model = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = value
    names = flags.split()
    return {
        "model": model or platform.processor() or platform.machine(),
        "avx2": "avx2" in names,
        "avx512f": "avx512f" in names,
        "avx512_vnni": "avx512_vnni" in names,
    }


def host() -> dict[str, Any]:
    """This host's CPU, and the ISA the CPU kernels were told to use (None: the best found)."""
    cpuinfo = ""
    with contextlib.suppress(OSError):
        cpuinfo = Path("/proc/cpuinfo").read_text()
    return {**host_cpu(cpuinfo), "specserve_cpu_isa": os.environ.get("SPECSERVE_CPU_ISA")}


def cpu_isa(info: dict[str, Any] | None = None) -> str:
    """The widest x86 vector ISA the CPU kernels may use on this host (or on `info`, a host()):
    avx512, avx2 or other; SPECSERVE_CPU_ISA=avx2 keeps an AVX-512 host on AVX2."""
    info = host() if info is None else info
    if info["avx512f"] and info["specserve_cpu_isa"] != "avx2":
        return "avx512"
    return "avx2" if info["avx2"] else "other"
