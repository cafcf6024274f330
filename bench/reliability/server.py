"""The server bench/reliability/run.py drives: a `specserve serve` subprocess with an API key (the
engine check answers only behind one), and what the bench reads from it: the /metrics gauges and
counters, GET /internal/engine-check, and the process's resident set from /proc."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from bench.common.processes import serving
from bench.policy.counters import parse_prometheus

RUNNING = "specserve:num_requests_running"
WAITING = "specserve:num_requests_waiting"
KV_USAGE = "specserve:kv_cache_usage_perc"
PREEMPTIONS = "specserve:num_preemptions_total"


@dataclasses.dataclass(frozen=True)
class Server:
    """A running server: where it listens, its process id and the headers it wants."""

    url: str
    pid: int
    model: str
    headers: dict[str, str]
    log_path: Path

    def client(self, concurrency: int, timeout: float = 600.0) -> httpx.AsyncClient:
        limits = httpx.Limits(
            max_connections=concurrency + 4, max_keepalive_connections=concurrency
        )
        return httpx.AsyncClient(
            base_url=self.url, headers=self.headers, timeout=timeout, limits=limits
        )


@dataclasses.dataclass(frozen=True)
class Idle:
    """The server after a phase: its gauges, the engine check and the preemptions so far."""

    num_running: float
    num_waiting: float
    kv_cache_usage: float
    num_preemptions: float
    check: dict[str, Any]
    waited_s: float

    @property
    def is_idle(self) -> bool:
        return (self.num_running, self.num_waiting, self.kv_cache_usage) == (0, 0, 0)


def server_config(
    model: str,
    dtype: str,
    num_kv_blocks: int,
    max_num_seqs: int,
    speculative_config: dict[str, Any] | None,
    max_model_len: int | None = None,
) -> dict[str, Any]:
    """The YAML config of the bench's server: a KV pool of `num_kv_blocks` 16-token blocks
    (small enough to preempt under the churn), `max_num_seqs` admitted at once."""
    engine: dict[str, Any] = {
        "model": model,
        "dtype": dtype,
        "block_size": 16,
        "num_kv_blocks": num_kv_blocks,
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": 256,
    }
    if max_model_len is not None:
        engine["max_model_len"] = max_model_len
    if speculative_config:
        engine["speculative_config"] = speculative_config
    server = {"host": "127.0.0.1", "served_model_name": "reliability", "log_stats_interval": 0}
    return {"engine": engine, "server": server}


@contextlib.contextmanager
def running_server(config: dict[str, Any], startup_timeout: float) -> Iterator[Server]:
    """`specserve serve` on `config` with a fresh API key, until the block ends. The log is
    kept in a temporary directory; its tail is raised if the server dies at start-up."""
    key = "sk-reliability-" + secrets.token_hex(8)
    config = {**config, "server": {**config["server"], "api_key": key}}
    with serving(config, startup_timeout, "specserve-reliability-") as (url, proc, log_path):
        headers = {"Authorization": f"Bearer {key}"}
        yield Server(url, proc.pid, config["server"]["served_model_name"], headers, log_path)


def metric(series: dict[str, list[tuple[dict[str, str], float]]], name: str) -> float:
    return sum(value for _, value in series.get(name, []))


async def read_idle(client: httpx.AsyncClient, timeout: float) -> Idle:
    """Wait until nothing runs or waits and no KV block is in use (aborted streams land a step
    or two after their clients leave), then run the engine check. After `timeout` seconds the
    state is read as it is: the caller reports it as not clean."""
    start = time.perf_counter()
    while True:
        series = parse_prometheus((await client.get("/metrics")).text)
        gauges = [metric(series, name) for name in (RUNNING, WAITING, KV_USAGE)]
        if gauges == [0, 0, 0] or time.perf_counter() - start > timeout:
            break
        await asyncio.sleep(0.1)
    response = await client.get("/internal/engine-check")
    check = response.json() if response.headers.get("content-type", "").startswith("app") else {}
    return Idle(*gauges, metric(series, PREEMPTIONS), check, time.perf_counter() - start)


def rss_kib(pid: int) -> int:
    """The process's resident set (VmRSS) in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for process {pid}")
