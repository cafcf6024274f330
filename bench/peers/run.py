"""specserve against llama.cpp's server and vLLM-CPU: the same weights, the same streaming client,
one server at a time with nothing else running.

Engines (--engines, one column each): specserve (dense bf16 weights), specserve-gguf (the
shipped GGUF's own Q4_K_M blocks, --quantization gguf), vllm-cpu (bf16, the Hugging Face
directory specserve converted the bundled model into), llama.cpp-bf16 (the shipped GGUF
requantised to BF16: the same values as specserve's bf16 weights) and llama.cpp-q4_k_m (the
shipped GGUF). bench/peers/setup.py installs the peers under --peers-dir on first use.

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
bench/peers/process.py watches each server's process tree (RSS, leftovers); bench/peers/report.py
formats the table.

    python -m bench.peers [--engines specserve,specserve-gguf,vllm-cpu,llama.cpp-bf16,...]
        [--peers-dir ~/.cache/specserve/peers] [--llama-cpp-src DIR] [--max-tokens 128]
    python -m bench.peers --smoke     # specserve on SmolLM2-135M, a few tokens: ~90 s
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from bench.common.processes import free_port
from bench.peers import setup
from bench.peers.process import serving, tree_rss_bytes
from bench.peers.report import FAMILIES, fmt, format_report, machine_info
from bench.policy.clients import chat_body, stream_request
from bench.policy.measurements import RequestResult
from bench.policy.workload import FUNCTIONS, OPEN_CHAT, code_edit_prompts, mixed_prompts

ROOT = Path(__file__).resolve().parents[2]

logger = logging.getLogger("bench.peers")

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
    """The batch-1 prompt families: bench/spec.py's three prompts first, then
    bench/policy/workload.py's code edits, its functions to repeat, and its open chat questions."""
    from bench.spec import WORKLOADS as SPEC_PROMPTS  # imports torch: only when a bench runs

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
    return {**chat_body(model, prompt, max_tokens), "ignore_eos": True}


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
        logger.info("%s %s: %s tokens/s", spec, family, fmt(out["families"][family], 1))
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
            logger.info("%d streams: %s tokens/s", c, fmt(out["streams"][str(c)], 1))
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


# --------------------------------------------------------------------------- servers


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


# --------------------------------------------------------------------------- main


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def parse_args(argv: Sequence[str] | None = None) -> tuple[BenchSettings, argparse.Namespace]:
    parser = argparse.ArgumentParser(
        prog="python -m bench.peers", description=__doc__.splitlines()[0]
    )
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
        # After the install: the peer's version is known.
        machine = machine_info(settings.setup.peers_dir)
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
