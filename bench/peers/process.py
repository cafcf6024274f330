"""bench/peers/run.py's view of a server's processes: the resident memory of its whole process tree
(sampled on a thread while it runs, loading included), the children it leaves behind (stopped
before the next server starts), how busy the CPU was before it, and `serving`, which starts one
server and stops it with all of that. Kept apart from the measurements: this is /proc and
signals, not HTTP."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from bench.common.processes import running, wait_ready
from bench.peers import setup

logger = logging.getLogger("bench.peers")


def tree_rss_bytes(pid: int) -> int:
    """Resident memory of `pid` and all its descendants, summed (psutil when installed, else
    /proc). Processes that exit while being read are skipped."""
    try:
        import psutil
    except ImportError:
        return sum(_proc_rss(p) for p in [pid, *_proc_descendants(pid)])
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            total += proc.memory_info().rss
    return total


def _proc_descendants(pid: int) -> list[int]:
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = (entry / "stat").read_text()
                ppid = int(stat[stat.rindex(")") + 2 :].split()[1])  # the name may hold spaces
                parents.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return found


def _proc_rss(pid: int) -> int:
    try:
        resident_pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (with the pid, an identity that pid
    reuse cannot fake); None once it is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # the name may hold spaces
    return None if fields[0] in ("Z", "X") else int(fields[19])


def stop_leftovers(seen: dict[int, int | None], timeout: float = 30.0) -> None:
    """SIGTERM, then SIGKILL, the processes of `seen` (pid: start time) still alive: children a
    server left behind must not run beside the next one."""
    alive = [p for p, t in seen.items() if t is not None and _start_time(p) == t]
    for pid in alive:
        logger.warning("stopping process %d that the server left behind", pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _start_time(p) == seen[p]]
        time.sleep(0.2)
    for pid in alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


class PeakRss:
    """Samples a process tree's RSS on a thread every `interval` seconds: `peak` in bytes, and
    `seen`, every descendant met (pid: start time)."""

    def __init__(self, pid: int, interval: float = 0.5) -> None:
        self.pid, self.interval, self.peak = pid, interval, 0
        self.seen: dict[int, int | None] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while True:
            self.peak = max(self.peak, tree_rss_bytes(self.pid))
            for pid in _proc_descendants(self.pid):
                self.seen.setdefault(pid, _start_time(pid))
            if self._stop.wait(self.interval):
                return

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def cpu_busy_share(interval: float = 1.0) -> float:
    """The share of the machine's CPU time that was busy over `interval` seconds (/proc/stat)."""

    def read() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
        idle = fields[3] + fields[4]  # idle + iowait
        return sum(fields) - idle, sum(fields)

    busy0, total0 = read()
    time.sleep(interval)
    busy1, total1 = read()
    return (busy1 - busy0) / max(1, total1 - total0)


@contextlib.contextmanager
def serving(command: setup.ServerCommand, log_path: Path, timeout: float) -> Iterator[PeakRss]:
    """Start the server, yield its RSS sampler once /health answers 200; stop it and whatever
    children it left behind."""
    busy = cpu_busy_share()
    if busy > 0.25:
        logger.warning(
            "the CPU was %.0f%% busy before the server: something else runs?", 100 * busy
        )
    logger.info("$ %s  (log: %s)", " ".join(command.with_env()), log_path)
    seen: dict[int, int | None] = {}
    try:
        with running(command.with_env(), log_path) as proc, PeakRss(proc.pid) as rss:
            seen = rss.seen
            port = command.argv[command.argv.index("--port") + 1]
            wait_ready(f"http://127.0.0.1:{port}{command.health_path}", proc, log_path, timeout)
            yield rss
    finally:
        stop_leftovers(seen)
