"""Child processes for the scripts that drive a real server (bench/policy.py,
deploy/grafana/render_dashboard.py): a free port, a process stopped on the way out, and a wait
until it answers."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


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
