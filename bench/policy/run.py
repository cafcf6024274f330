"""The speculation policy over HTTP: modes off / always / auto side by side in one run.

One `specserve serve` on the config, started in auto (the mode that calibrates), warmed up once
per mode; the prefix cache holds every prompt of every workload measured before the first level
(one 1-token request each), so the levels measure the steady state of a server that has seen its
prompts. A level is one workload at one concurrency: every workload of --workloads (default
mixed: code edits and open chat interleaved; also code_edit, open_chat, code_gen — functions to
complete, as in HumanEval; bench/policy/workload.py) at every concurrency of --concurrency. In a
level, c streaming clients hold c chat requests in flight — a client sends its next request
(greedy, --max-tokens, drawn round-robin from the level's workload) as soon as its last one ends;
holding the concurrency measures the engine at c, not a ramp-down through every concurrency below
it. Request n of a level asks for max_tokens * (1 - s + 2 s u_n) tokens (--length-spread s, 0.5
by default; u_n evenly spread, the same in every mode), so the clients do not start and end their
requests in step. The mode is switched through the operator route `PUT /internal/speculation`, in
one of two ways:

- slices (the default, --slice seconds, c / 8 times that past 8 clients): the clients never stop
  for the whole level; the modes take turns, one slice each per round (--rounds), in an order
  that rotates each round, after a lead-in of one slice that is not counted (the clients' first
  requests arrive together), and each slice's tokens/s is the server's own count for its mode (the
  generation tokens over the seconds of the engine steps decided in it; bench/policy/clients.py).
  On this class of host a level's throughput drifts by up to a fifth between windows minutes
  apart, and slices share that drift, the requests in flight and the prefix cache between the
  modes;
- windows (--slice 0): each round measures every mode in a window of its own (--duration
  seconds, c / 8 times that past 8 clients) from the same place in the workload, the requests
  still streaming at its end cut off; tokens/s counts the tokens streamed inside the window.
  --prefix-cache cold empties the cache before each window (`POST /internal/reset-prefix-cache`).

Per (mode, workload, c) and round: total tokens/s, TTFT p50/p99, inter-token latency p50/p99 (per
token, amortised over the tokens of one step) and the share of the policy's per-request decisions
that speculated (/metrics deltas). Then a code-edit-only level at concurrency 1 (none with
--no-code-edit-c1, or when the sweep already holds it). The server runs with max_num_seqs >= the
largest concurrency and --kv-cache-gib of KV cache.

Prints a markdown table per workload (medians over the rounds, with their range), "auto vs
best(off, always)" per workload and concurrency (auto over the better fixed mode in the same
round, the median of the rounds) and whether the targets hold, judged on the mixed workload (auto
within 3% of the best at every c; code edit at c=1: auto >= 1.5x off); writes JSON (--out) and a
PNG (--plot, needs the `bench` extra: matplotlib); bench/policy/report.py formats them. The
flags below are parsed in bench/policy/settings.py.

    python -m bench.policy [--config configs/default.yaml] [--modes off,always,auto]
        [--concurrency 1,2,4,8,16,32] [--slice 10] [--rounds 6] [--max-tokens 96]
    python -m bench.policy --slice 0 --rounds 3 --duration 20    # windows
    python -m bench.policy --workloads mixed,code_gen --concurrency 1,4
    python -m bench.policy --smoke     # SmolLM2-135M, n-gram, c = 1, 2, one round: a minute
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import secrets
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx

from bench.common.processes import host, serving
from bench.policy.clients import chat_body, run_level, run_sliced, stream_request
from bench.policy.measurements import LevelResult, RequestResult, summarize_level
from bench.policy.report import check_targets, plot, report
from bench.policy.settings import BenchSettings, parse_args
from bench.policy.workload import WORKLOADS

ROOT = Path(__file__).resolve().parents[2]
logger = logging.getLogger("bench.policy")


def levels_of(settings: BenchSettings) -> list[tuple[str, int]]:
    """The (workload, concurrency) levels in the order they run: every workload at every
    concurrency, then code edit at c = 1 if asked for and not already among them."""
    levels = [(w, c) for w in settings.workloads for c in settings.concurrency]
    if settings.is_code_edit_c1 and ("code_edit", 1) not in levels:
        levels.append(("code_edit", 1))
    return levels


# --------------------------------------------------------------------------- the server


def server_config(
    base: dict[str, Any], max_num_seqs: int, kv_cache_memory: int | None = None
) -> dict[str, Any]:
    """A copy of the YAML config that starts in auto (so the step-time model is calibrated and
    every mode can be switched to), streams one SSE chunk per token, admits `max_num_seqs`
    requests at once (at least the config's), if given sizes the KV cache, and has an API key
    (the operator routes answer only behind one): SPECSERVE_API_KEY's, else the config's, else
    a new one."""
    engine = dict(base.get("engine") or {})
    spec = engine.get("speculative_config")
    if not spec:
        raise SystemExit("bench.policy: the config has no engine.speculative_config to vary.")
    engine["speculative_config"] = {**spec, "mode": "auto"}
    engine["max_num_seqs"] = max(int(engine.get("max_num_seqs", 16)), max_num_seqs)
    if kv_cache_memory is not None:
        engine["kv_cache_memory"] = kv_cache_memory
    server = {**(base.get("server") or {}), "host": "127.0.0.1"}
    server["stream_one_token_per_chunk"] = True  # one arrival time per token
    key = os.environ.get("SPECSERVE_API_KEY") or server.get("api_key")  # as the server reads it
    server["api_key"] = key or f"sk-bench-{secrets.token_hex(12)}"
    return {"engine": engine, "server": server}


@contextlib.contextmanager
def running_server(config: dict[str, Any], startup_timeout: float) -> Iterator[str]:
    """Start `specserve serve` on `config`, yield its base URL once /health is 200, stop it."""
    with serving(config, startup_timeout) as (url, _, _):
        yield url


def auth_headers(config: dict[str, Any]) -> dict[str, str]:
    key = os.environ.get("SPECSERVE_API_KEY") or (config.get("server") or {}).get("api_key")
    return {"Authorization": f"Bearer {key}"} if key else {}


def window_order(modes: Sequence[str], round_index: int) -> list[str]:
    """The modes of one round of a level: rotated by the round, and from the second len(modes)
    rounds on reversed too, so over 2 * len(modes) rounds each mode goes first, middle and last
    as often as the others and follows each of them as often (a slice inherits the requests in
    flight from the one before it)."""
    n = len(modes)
    order = list(modes) if (round_index // n) % 2 == 0 else list(reversed(modes))
    shift = round_index % n
    return [*order[shift:], *order[:shift]]


def prompt_offset(num_prompts: int, round_index: int, rounds: int) -> int:
    """Where a round's clients start in the workload: the rounds spread over it (even offsets,
    so a mixed round still starts on a code edit), and every mode of a round starts alike."""
    return (round_index * num_prompts // rounds) // 2 * 2


def bench_all(settings: BenchSettings) -> list[LevelResult]:
    """Every level, round and mode on one server; the windows of a level's round back to back."""
    levels = levels_of(settings)
    config = server_config(settings.config, max(settings.concurrency), settings.kv_cache_memory)
    headers = auth_headers(config)
    results = []
    with running_server(config, settings.startup_timeout) as url:
        model = httpx.get(f"{url}/v1/models", headers=headers).json()["data"][0]["id"]
        for mode in settings.modes:  # each mode's first-use costs out of the windows
            operate(url, headers, mode, is_cold=False)
            warm_up(url, headers, model, settings)
        if not settings.is_cold:
            prompts = dict.fromkeys(p for workload, _ in levels for p in WORKLOADS[workload]())
            asyncio.run(fill_prefix_cache(url, headers, model, list(prompts)))
        for workload, c in levels:
            prompts = WORKLOADS[workload]()
            measure = measure_sliced if settings.slice > 0 else measure_windows
            for level in measure(url, headers, model, workload, prompts, c, settings):
                logger.info(
                    "%s %s c=%d round %d: %.2f tokens/s",
                    level.mode,
                    workload,
                    c,
                    level.round + 1,
                    level.tokens_per_s,
                )
                results.append(level)
    return results


def measure_windows(
    url: str,
    headers: dict[str, str],
    model: str,
    workload: str,
    prompts: Sequence[str],
    c: int,
    settings: BenchSettings,
) -> Iterator[LevelResult]:
    """A level in windows: each round, every mode in its own window from the round's offset."""
    for round_index in range(settings.rounds):
        offset = prompt_offset(len(prompts), round_index, settings.rounds)
        for mode in window_order(settings.modes, round_index):
            operate(url, headers, mode, settings.is_cold)
            runs, window, share = asyncio.run(
                run_level(url, headers, model, prompts, c, settings, offset)
            )
            _log_errors(mode, c, runs)
            level = summarize_level(mode, workload, c, runs, window, share, settings.burst_gap)
            yield dataclasses.replace(level, round=round_index)


def measure_sliced(
    url: str,
    headers: dict[str, str],
    model: str,
    workload: str,
    prompts: Sequence[str],
    c: int,
    settings: BenchSettings,
) -> Iterator[LevelResult]:
    """A level in slices: one load, the modes in turn (rotating each round); each slice's
    tokens/s is the server's count for its mode, tokens over the seconds of its steps."""
    schedule = [(r, m) for r in range(settings.rounds) for m in window_order(settings.modes, r)]
    runs, slices = asyncio.run(run_sliced(url, headers, model, prompts, c, settings, schedule))
    _log_errors("sliced", c, runs)
    for s in slices:
        level = summarize_level(s.mode, workload, c, runs, s.window, s.share, settings.burst_gap)
        yield dataclasses.replace(
            level,
            round=s.round,
            num_completion_tokens=int(s.num_tokens),
            wall_time=s.seconds,
            tokens_per_s=s.num_tokens / s.seconds if s.seconds > 0 else 0.0,
        )


def _log_errors(mode: str, c: int, runs: Sequence[RequestResult]) -> None:
    for r in runs:
        if r.error:
            logger.warning("%s c=%d: request failed: %s", mode, c, r.error)


def operate(url: str, headers: dict[str, str], mode: str, is_cold: bool) -> None:
    """Switch the server to `mode` and, if cold, empty its prefix cache (between windows)."""
    response = httpx.put(f"{url}/internal/speculation", json={"mode": mode}, headers=headers)
    if response.status_code != 200:
        raise RuntimeError(f"could not switch to {mode}: {response.text[:300]}")
    if not is_cold:
        return
    response = httpx.post(f"{url}/internal/reset-prefix-cache", headers=headers)
    if response.status_code != 200:
        raise RuntimeError(f"could not reset the prefix cache: {response.text[:300]}")


async def fill_prefix_cache(
    url: str, headers: dict[str, str], model: str, prompts: Sequence[str]
) -> None:
    """Each prompt once, one token each, so their prefixes are cached before the windows."""
    async with httpx.AsyncClient(base_url=url, timeout=900.0, headers=headers) as client:
        for prompt in prompts:
            body = {**chat_body(model, prompt, 1), "stream": False}
            body.pop("stream_options")
            response = await client.post("/v1/chat/completions", json=body)
            if response.status_code != 200:
                raise RuntimeError(f"filling the prefix cache failed: {response.text[:300]}")


def warm_up(url: str, headers: dict[str, str], model: str, settings: BenchSettings) -> None:
    """One request, so the first window does not pay for first-use costs."""

    async def one() -> RequestResult:
        async with httpx.AsyncClient(base_url=url, timeout=900.0, headers=headers) as client:
            body = chat_body(model, WORKLOADS["mixed"]()[0], settings.max_tokens)
            return await stream_request(client, body, 0)

    result = asyncio.run(one())
    if result.error:
        raise RuntimeError(f"warm-up failed: {result.error}")


# --------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    settings, args = parse_args(argv)
    start = time.perf_counter()
    levels = bench_all(settings)
    logger.info("swept %d windows in %.0f s", len(levels), time.perf_counter() - start)
    sys.stdout.write(report(levels))
    out = ROOT / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "host": host(),
        "settings": dataclasses.asdict(settings),
        "levels": [dataclasses.asdict(r) for r in levels],
        "targets": check_targets(levels),
    }
    out.write_text(json.dumps(payload, indent=2) + "\n")
    try:
        plot(levels, ROOT / args.plot, settings.workloads)
    except ImportError as e:  # the figures are in the JSON; the plot needs the bench extra
        logger.warning("wrote %s; no plot (%s: pip install -e '.[bench]')", out, e)
        return
    logger.info("wrote %s and %s", out, ROOT / args.plot)


if __name__ == "__main__":
    main()
