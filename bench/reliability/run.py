"""Reliability of a real `specserve serve` under churn, over a soak and against a fuzzer.

One server (SmolLM2-135M, float32 on the CPU, n-gram speculation always on, a KV pool small
enough that the churn preempts) serves three parts in turn:

1. churn: --requests streaming requests (chat and completions, greedy, drawn from --distinct
   prompts and max_tokens) at --concurrency, a --cancel-fraction of them closed by the client at
   a random moment (after 0-8 chunks, 0 meaning before the first, or after a random delay).
   Then: running, waiting and KV usage on /metrics are 0, GET /internal/engine-check (the block
   manager's integrity check, run on the engine thread) passes, /metrics counted preemptions, and
   every request that completed equals the same request run alone afterwards, text and token
   count (each distinct request once, one at a time).
2. soak: --soak-minutes at --concurrency streams (same draw, same cancellations), the server's
   VmRSS sampled every --rss-interval seconds: RSS at minute 1 (a third of the soak if it is
   shorter), at the end, and the growth (target < 5%); then the same idle checks.
3. fuzz: --fuzz-cases schemathesis cases over createChatCompletion and createCompletion,
   positive and negative, streaming included (bench/reliability/fuzz.py): 5xx responses
   (target 0), requests with no response, 200 streams without [DONE]; then the idle checks.

Prints a table and writes --out (JSON). Exits 1 when a correctness check fails (the RSS target
is reported, not enforced).

    python -m bench.reliability [--requests 1000] [--concurrency 32] [--cancel-fraction 0.3]
        [--soak-minutes 10] [--fuzz-cases 1600] [--model smollm2-135m-instruct]
    python -m bench.reliability --short    # the same at small scale: a few minutes
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import platform
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.reliability.fuzz import FuzzResult, run_fuzz
from bench.reliability.report import churn_summary, report, soak_summary, verdicts
from bench.reliability.server import (
    Idle,
    Server,
    read_idle,
    rss_kib,
    running_server,
    server_config,
)
from bench.reliability.workload import (
    RequestSpec,
    StreamResult,
    draw_cancel,
    make_specs,
    stream_one,
)

ROOT = Path(__file__).resolve().parents[2]

logger = logging.getLogger("bench.reliability")

# A few minutes: 120 streams at c=16 over a pool under half of what they take at once.
SHORT = dict(
    requests=120, concurrency=16, distinct=30, soak_minutes=1.0, fuzz_cases=200, num_kv_blocks=32
)


@dataclasses.dataclass(frozen=True)
class BenchSettings:
    """What one run does, resolved from the flags."""

    model: str = "smollm2-135m-instruct"
    dtype: str = "float32"
    speculative_config: dict[str, Any] | None = dataclasses.field(
        default_factory=lambda: {"method": "ngram", "num_speculative_tokens": 5, "mode": "always"}
    )
    # 16-token blocks: 1,024 tokens, about a third of what 32 requests of ~30 prompt tokens and
    # up to 64 new ones take at once (64 blocks at c=16 did not preempt: 62% used at most).
    num_kv_blocks: int = 64
    max_num_seqs: int = 32
    requests: int = 1000
    concurrency: int = 32
    cancel_fraction: float = 0.3
    max_cancel_delay: float = 2.0  # seconds
    distinct: int = 100
    max_tokens: tuple[int, int] = (8, 64)
    soak_minutes: float = 10.0
    rss_interval: float = 5.0  # seconds
    fuzz_cases: int = 1600
    seed: int = 0
    idle_timeout: float = 60.0
    startup_timeout: float = 900.0


@dataclasses.dataclass(frozen=True)
class ChurnResult:
    """The churn's counts and checks."""

    num_requests: int
    num_completed: int
    num_cancelled: int
    num_cancel_planned: int  # some planned cancellations came after the request had finished
    num_errors: int
    num_preemptions: float  # during the churn (/metrics counter delta)
    idle: Idle
    num_compared: int  # completed requests compared with their solo run
    num_distinct_compared: int
    mismatches: tuple[dict[str, Any], ...]
    errors: tuple[str, ...]  # the first few
    seconds: float


@dataclasses.dataclass(frozen=True)
class SoakResult:
    """The soak's counts, RSS samples [(seconds from the start, KiB)] and figures."""

    seconds: float
    num_completed: int
    num_cancelled: int
    num_errors: int
    rss_samples: tuple[tuple[float, int], ...]
    baseline_at_s: float
    rss_baseline_kib: int
    rss_end_kib: int
    rss_growth_pct: float
    idle: Idle
    errors: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Results:
    churn: ChurnResult | None
    soak: SoakResult | None
    fuzz: FuzzResult | None
    fuzz_idle: Idle | None


# --------------------------------------------------------------------------- churn


async def run_churn(
    server: Server, settings: BenchSettings, specs: list[RequestSpec]
) -> ChurnResult:
    rng = random.Random(settings.seed)
    draws = [
        (
            rng.randrange(len(specs)),
            draw_cancel(rng, settings.cancel_fraction, settings.max_cancel_delay),
        )
        for _ in range(settings.requests)
    ]
    gate = asyncio.Semaphore(settings.concurrency)
    async with server.client(settings.concurrency) as client:
        before = (await read_idle(client, settings.idle_timeout)).num_preemptions
        start = time.perf_counter()

        async def one(index: int, plan: Any) -> StreamResult:
            async with gate:
                return await stream_one(client, specs[index], index, server.model, plan)

        results = await asyncio.gather(*(one(index, plan) for index, plan in draws))
        seconds = time.perf_counter() - start
        idle = await read_idle(client, settings.idle_timeout)
        completed = [r for r in results if r.outcome == "completed"]
        solo: dict[int, StreamResult] = {}
        for index in sorted({r.spec_index for r in completed}):
            solo[index] = await stream_one(client, specs[index], index, server.model)
    errors = [r.error or "" for r in results if r.outcome == "error"]
    errors += [f"solo {i}: {r.error}" for i, r in solo.items() if r.outcome != "completed"]
    return ChurnResult(
        num_requests=len(results),
        num_completed=len(completed),
        num_cancelled=sum(r.outcome == "cancelled" for r in results),
        num_cancel_planned=sum(plan is not None for _, plan in draws),
        num_errors=len(errors),
        num_preemptions=idle.num_preemptions - before,
        idle=idle,
        num_compared=len(completed),
        num_distinct_compared=len(solo),
        mismatches=tuple(mismatches(completed, solo)),
        errors=tuple(errors[:5]),
        seconds=seconds,
    )


def mismatches(
    completed: Sequence[StreamResult], solo: dict[int, StreamResult]
) -> list[dict[str, Any]]:
    """The completed requests whose text or token count differs from their solo run's."""
    found = []
    for r in completed:
        alone = solo[r.spec_index]
        if (r.text, r.num_completion_tokens) == (alone.text, alone.num_completion_tokens):
            continue
        at = next(
            (i for i, (a, b) in enumerate(zip(r.text, alone.text, strict=False)) if a != b), None
        )
        at = min(len(r.text), len(alone.text)) if at is None else at
        found.append(
            {
                "spec_index": r.spec_index,
                "first_difference_at": at,
                "tokens": [r.num_completion_tokens, alone.num_completion_tokens],
                "churn": r.text[max(0, at - 20) : at + 40],
                "solo": alone.text[max(0, at - 20) : at + 40],
            }
        )
    return found


# --------------------------------------------------------------------------- soak


async def run_soak(server: Server, settings: BenchSettings, specs: list[RequestSpec]) -> SoakResult:
    rng = random.Random(settings.seed + 1)
    duration = settings.soak_minutes * 60
    results: list[StreamResult] = []
    samples: list[tuple[float, int]] = []
    start = time.perf_counter()
    end = start + duration

    is_done = asyncio.Event()

    async def sample() -> None:  # until the last request ends, not only until `end`
        while not is_done.is_set():
            samples.append((time.perf_counter() - start, rss_kib(server.pid)))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(is_done.wait(), settings.rss_interval)

    async def client_loop(client: Any) -> None:
        while time.perf_counter() < end:
            index = rng.randrange(len(specs))
            plan = draw_cancel(rng, settings.cancel_fraction, settings.max_cancel_delay)
            results.append(await stream_one(client, specs[index], index, server.model, plan))

    async def clients(client: Any) -> None:
        await asyncio.gather(*(client_loop(client) for _ in range(settings.concurrency)))
        is_done.set()

    async with server.client(settings.concurrency) as client:
        await asyncio.gather(sample(), clients(client))
        idle = await read_idle(client, settings.idle_timeout)
    samples.append((time.perf_counter() - start, rss_kib(server.pid)))  # at rest, after it all
    baseline_at = min(60.0, duration / 3)
    baseline = next((kib for t, kib in samples if t >= baseline_at), samples[-1][1])
    errors = [r.error or "" for r in results if r.outcome == "error"]
    return SoakResult(
        seconds=time.perf_counter() - start,
        num_completed=sum(r.outcome == "completed" for r in results),
        num_cancelled=sum(r.outcome == "cancelled" for r in results),
        num_errors=len(errors),
        rss_samples=tuple((round(t, 1), kib) for t, kib in samples),
        baseline_at_s=baseline_at,
        rss_baseline_kib=baseline,
        rss_end_kib=samples[-1][1],
        rss_growth_pct=100.0 * (samples[-1][1] - baseline) / baseline,
        idle=idle,
        errors=tuple(errors[:5]),
    )


# --------------------------------------------------------------------------- the run


def run_all(settings: BenchSettings, parts: Sequence[str] = ("churn", "soak", "fuzz")) -> Results:
    """The parts asked for, in order, on one server."""
    from tests.openapi_spec import SPEC_PATH

    specs = make_specs(settings.distinct, settings.max_tokens, random.Random(settings.seed))
    config = server_config(
        settings.model,
        settings.dtype,
        settings.num_kv_blocks,
        settings.max_num_seqs,
        settings.speculative_config,
    )
    churn = soak = fuzz = fuzz_idle = None
    with running_server(config, settings.startup_timeout) as server:
        if "churn" in parts:
            churn = asyncio.run(run_churn(server, settings, specs))
            logger.info("churn: %s", churn_summary(churn))
        if "soak" in parts:
            soak = asyncio.run(run_soak(server, settings, specs))
            logger.info("soak: %s", soak_summary(soak))
        if "fuzz" in parts:
            fuzz = run_fuzz(
                server.url, server.model, server.headers, settings.fuzz_cases, str(SPEC_PATH)
            )
            fuzz_idle = asyncio.run(_idle(server, settings.idle_timeout))
    return Results(churn, soak, fuzz, fuzz_idle)


async def _idle(server: Server, timeout: float) -> Idle:
    async with server.client(1) as client:
        return await read_idle(client, timeout)


def parse_args(argv: Sequence[str] | None = None) -> tuple[BenchSettings, argparse.Namespace]:
    defaults = BenchSettings()
    parser = argparse.ArgumentParser(
        prog="python -m bench.reliability", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model", default=defaults.model)
    parser.add_argument("--dtype", default=defaults.dtype)
    parser.add_argument("--num-kv-blocks", type=int, default=defaults.num_kv_blocks)
    parser.add_argument(
        "--spec-mode",
        default="always",
        choices=("always", "auto", "off"),
        help="n-gram speculation's mode (always: every step verifies drafts, so preemption and "
        "cancellation meet KV written for rejected drafts; auto lets the policy turn it off)",
    )
    parser.add_argument("--requests", type=int, default=defaults.requests)
    parser.add_argument("--concurrency", type=int, default=defaults.concurrency)
    parser.add_argument("--cancel-fraction", type=float, default=defaults.cancel_fraction)
    parser.add_argument("--distinct", type=int, default=defaults.distinct, help="distinct requests")
    parser.add_argument("--soak-minutes", type=float, default=defaults.soak_minutes)
    parser.add_argument("--rss-interval", type=float, default=defaults.rss_interval)
    parser.add_argument("--fuzz-cases", type=int, default=defaults.fuzz_cases)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--parts", default="churn,soak,fuzz")
    parser.add_argument("--out", default="bench/results/reliability.json")
    parser.add_argument("--short", action="store_true", help="a few minutes: " + json.dumps(SHORT))
    args = parser.parse_args(argv)
    if args.short:
        for name, value in SHORT.items():
            setattr(args, name, value)
        if args.out == parser.get_default("out"):
            args.out = "bench/results/reliability-short.json"
    settings = BenchSettings(
        model=args.model,
        dtype=args.dtype,
        speculative_config={**(defaults.speculative_config or {}), "mode": args.spec_mode},
        num_kv_blocks=args.num_kv_blocks,
        max_num_seqs=max(defaults.max_num_seqs, args.concurrency),
        requests=args.requests,
        concurrency=args.concurrency,
        cancel_fraction=args.cancel_fraction,
        distinct=args.distinct,
        soak_minutes=args.soak_minutes,
        rss_interval=args.rss_interval,
        fuzz_cases=args.fuzz_cases,
        seed=args.seed,
    )
    return settings, args


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    settings, args = parse_args(argv)
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    results = run_all(settings, tuple(args.parts.split(",")))
    checks = verdicts(results)
    sys.stdout.write(report(results, checks))
    out = ROOT / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "command": "python -m bench.reliability "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "started": started,
        "host": {"machine": platform.machine(), "processor": platform.processor()},
        "settings": dataclasses.asdict(settings),
        **{name: _plain(getattr(results, name)) for name in ("churn", "soak", "fuzz", "fuzz_idle")},
        "checks": checks,
    }
    out.write_text(json.dumps(payload, indent=2) + "\n")
    logger.info("wrote %s", out)
    return 0 if all(c["held"] for c in checks if c["kind"] == "correctness") else 1


def _plain(value: Any) -> Any:
    return None if value is None else dataclasses.asdict(value)


if __name__ == "__main__":
    sys.exit(main())
