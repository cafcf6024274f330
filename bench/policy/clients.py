"""The clients of bench/policy/run.py: streamed chat requests from c closed-loop clients, measured
in windows (one mode per window) or in slices (the modes in turn under one continuous load).

Slices: on this class of host the same level of the same mode moves by up to a fifth between
windows minutes apart (off at 32 clients: 22% across three rounds,
bench/results/policy-windows.json), so windows taken one after the other compare
the host as much as the modes. In a sliced level the clients never stop: every
`--slice` seconds the server is switched to the next mode (`PUT /internal/speculation`), and each
mode's throughput is what the server counts for it — the generation tokens and the seconds of the
engine steps decided in that mode (`specserve:spec_decode_mode_*_total`), read around each switch.
A switch lands between two steps, so each step counts whole, under the mode that decided it; and
the modes share the requests in flight, the prefix cache and the host's drift.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import httpx

from bench.policy.counters import (
    decision_counts,
    mode_counters,
    parse_prometheus,
    speculating_share,
)
from bench.policy.measurements import ChatStreamReader, RequestResult

if TYPE_CHECKING:
    from bench.policy.settings import BenchSettings

BUSY = ("specserve:num_requests_running", "specserve:num_requests_waiting")
LONGER_FROM = 8  # concurrency past which a level's window grows with c


def level_client(url: str, headers: dict[str, str], concurrency: int) -> httpx.AsyncClient:
    """The client of one level: a connection per streaming client, and room for the scrapes and
    switches beside them."""
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency)
    return httpx.AsyncClient(
        base_url=url, timeout=httpx.Timeout(900.0), limits=limits, headers=headers
    )


async def scrape(client: httpx.AsyncClient) -> dict[str, list[tuple[dict[str, str], float]]]:
    return parse_prometheus((await client.get("/metrics")).text)


async def stream_request(
    client: httpx.AsyncClient,
    body: dict[str, Any],
    prompt_index: int,
    reader: ChatStreamReader | None = None,
) -> RequestResult:
    """One streamed chat completion; a failure becomes a result with `error` set. Cancelling
    the task closes the stream (the server aborts the request); `reader` keeps what arrived."""
    reader = reader or ChatStreamReader(time.perf_counter())
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                raise RuntimeError(f"HTTP {response.status_code}: {text[:300]}")
            async for line in response.aiter_lines():
                reader.feed(line, time.perf_counter())
        if not reader.is_done:
            raise RuntimeError("the stream ended without [DONE]")
    except Exception as e:  # noqa: BLE001 - a failed request is counted, the level goes on
        now = time.perf_counter()
        return dataclasses.replace(reader.result(prompt_index, now), error=str(e))
    return reader.result(prompt_index, time.perf_counter())


async def run_level(
    url: str,
    headers: dict[str, str],
    model: str,
    prompts: Sequence[str],
    concurrency: int,
    settings: BenchSettings,
    offset: int = 0,
) -> tuple[list[RequestResult], tuple[float, float], float | None]:
    """c closed-loop clients for level_duration(...) seconds; client i sends prompts offset + i,
    offset + i + c, offset + i + 2c, ... (round-robin) and its request in flight when the window
    closes is cut off. Returns the results, the window (start, end) and the share of decisions
    that speculated."""
    async with level_client(url, headers, concurrency) as client:
        before = decision_counts(await scrape(client))
        start = time.perf_counter()
        end = start + level_duration(settings.duration, concurrency)
        results = await closed_loop(client, model, prompts, concurrency, settings, offset, end)
        await wait_idle(client, settings.startup_timeout)
        after = decision_counts(await scrape(client))
    return results, (start, end), speculating_share(before, after)


async def closed_loop(
    client: httpx.AsyncClient,
    model: str,
    prompts: Sequence[str],
    concurrency: int,
    settings: BenchSettings,
    offset: int,
    end: float,
) -> list[RequestResult]:
    """c clients until `end` (the bench's clock): client i sends prompts offset + i,
    offset + i + c, ... (round-robin), each as soon as its last one ended, asking for
    `request_max_tokens` tokens; the request in flight at `end` is cut off (cancelled)."""

    async def one_client(i: int) -> list[RequestResult]:
        results, j = [], 0
        while (left := end - time.perf_counter()) > 0:
            number = offset + j * concurrency + i
            index = number % len(prompts)
            max_tokens = request_max_tokens(settings.max_tokens, settings.length_spread, number)
            body = chat_body(model, prompts[index], max_tokens)
            reader = ChatStreamReader(time.perf_counter())
            try:
                result = await asyncio.wait_for(stream_request(client, body, index, reader), left)
            except TimeoutError:
                now = time.perf_counter()
                result = dataclasses.replace(reader.result(index, now), cancelled=True)
            results.append(result)
            j += 1
        return results

    per_client = await asyncio.gather(*(one_client(i) for i in range(concurrency)))
    return [r for rs in per_client for r in rs]


def request_max_tokens(max_tokens: int, spread: float, number: int) -> int:
    """The max_tokens of a level's request `number`: max_tokens * (1 - spread + 2 spread u),
    u the fractional part of number times the golden ratio (evenly spread, no two clients alike,
    the same in every mode). Requests that all ask for the same length start and end in step:
    at 16 clients all 16 prompts then arrive together (on a 2-core CPU seconds of prompt tails,
    a good share of a 20-s slice), and which slice that lands in decided the slice's mode's
    reading more than the mode did (docs/policy.md, "On an AVX2 host, by workload")."""
    u = (number * 0.6180339887498949) % 1.0
    return max(1, round(max_tokens * (1.0 - spread + 2.0 * spread * u)))


def level_duration(duration: float, concurrency: int) -> float:
    """The window of a level: `duration`, longer past LONGER_FROM clients in proportion to c —
    one round of c requests takes about c / LONGER_FROM times longer there (the batch is
    compute-bound), and a window must hold several rounds, not one round and its prefill
    burst."""
    return duration * max(1.0, concurrency / LONGER_FROM)


async def wait_idle(client: httpx.AsyncClient, timeout: float) -> None:
    """Until the server has aborted the cut-off requests: nothing running or waiting."""
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        series = await scrape(client)
        busy = sum(value for name in BUSY for _, value in series.get(name, []))
        if busy == 0:
            return
        await asyncio.sleep(0.1)
    raise RuntimeError(f"the server still had requests in flight after {timeout:.0f} s")


def chat_body(model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


@dataclasses.dataclass(frozen=True)
class Slice:
    """One mode's slice of a sliced level: its window on the bench's clock, and what the server
    counted for the mode in it."""

    round: int
    mode: str
    window: tuple[float, float]
    num_tokens: float  # generation tokens of the steps decided in the mode
    seconds: float  # their seconds
    share: float | None  # of the policy's decisions in the slice, those that speculated


async def run_sliced(
    url: str,
    headers: dict[str, str],
    model: str,
    prompts: Sequence[str],
    concurrency: int,
    settings: BenchSettings,
    schedule: Sequence[tuple[int, str]],
) -> tuple[list[RequestResult], list[Slice]]:
    """c closed-loop clients from the workload's start, for one slice (level_duration of
    settings.slice) per (round, mode) of `schedule`, in its order, after a lead-in of one slice
    in the first slice's mode that is not counted (the c clients' first requests all arrive at
    once: a burst no slice should carry). At each switch: scrape, switch, scrape again: the mode
    leaving is counted up to the second scrape (it runs no step after the switch), the mode
    arriving from the first (it ran none before)."""
    length = level_duration(settings.slice, concurrency)
    async with level_client(url, headers, concurrency) as client:
        await switch_mode(client, schedule[0][1])
        start = time.perf_counter() + length  # the first counted slice's
        end = start + length * len(schedule)
        load = asyncio.create_task(
            closed_loop(client, model, prompts, concurrency, settings, 0, end)
        )
        marks = []  # per slice: (scrape before the switch, scrape after it, time of the switch)
        try:
            for i, (_, mode) in enumerate(schedule):
                await asyncio.sleep(max(0.0, start + i * length - time.perf_counter()))
                before = await scrape(client)
                await switch_mode(client, mode)
                marks.append((before, await scrape(client), time.perf_counter()))
            results = await load
        finally:
            load.cancel()
        await wait_idle(client, settings.startup_timeout)
        marks.append((await scrape(client), await scrape(client), end))
    slices = []
    for i, (round_index, mode) in enumerate(schedule):
        (before, switched, at), (closing, after, until) = marks[i], marks[i + 1]
        old, new = mode_counters(before).get(mode), mode_counters(after).get(mode)
        if old is None or new is None:
            raise RuntimeError("the server exports no per-mode counters (spec_decode_mode_*)")
        share = speculating_share(decision_counts(switched), decision_counts(closing))
        tokens, seconds = new[0] - old[0], new[1] - old[1]
        slices.append(Slice(round_index, mode, (at, until), tokens, seconds, share))
    return results, slices


async def switch_mode(client: httpx.AsyncClient, mode: str) -> None:
    response = await client.put("/internal/speculation", json={"mode": mode})
    if response.status_code != 200:
        raise RuntimeError(f"could not switch to {mode}: {response.text[:300]}")
