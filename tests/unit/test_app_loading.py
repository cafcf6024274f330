"""Loading the engine off the event loop: on a thread of its own that ends with the load, so no
OpenMP team outlives it (see server.app._in_own_thread)."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest
import torch

from server.app import _in_own_thread


def _num_os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _wait_gone(prefix: str, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(t.name.startswith(prefix) for t in threading.enumerate()):
            return True
        time.sleep(0.01)
    return False


def test_result_comes_from_a_thread_that_then_ends():
    names = asyncio.run(_in_own_thread(lambda: threading.current_thread().name))
    assert names.startswith("specserve-loader")
    assert _wait_gone("specserve-loader")


def test_an_exception_reaches_the_awaiting_coroutine():
    def fail() -> None:
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        asyncio.run(_in_own_thread(fail))
    assert _wait_gone("specserve-loader")


@pytest.fixture
def two_threads():
    # Parallel work needs a team; `make test`'s workers keep torch to one thread each.
    num_threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(num_threads)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")
def test_parallel_work_leaves_no_worker_threads_behind(two_threads):
    """Parallel torch work on the loading thread starts OpenMP workers for that thread; they
    must be gone once loading is over (left alive, they make OpenMP stop spin-waiting in the
    engine thread's team, and every operator then sleeps and wakes its workers)."""
    x = torch.randn(512, 512)

    def parallel_work() -> int:
        for _ in range(3):
            x @ x
        return _num_os_threads()

    async def load_then_serve() -> tuple[int, int]:
        # The event loop stays up after loading, as a server's does (asyncio.run would shut a
        # default executor down on the way out and hide a worker pool left behind).
        during = await _in_own_thread(parallel_work)
        deadline = time.monotonic() + 5.0
        while _num_os_threads() > before and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return during, _num_os_threads()

    before = _num_os_threads()
    during, after = asyncio.run(load_then_serve())
    assert during > before + 1  # the loader itself and at least one OpenMP worker
    assert after == before
