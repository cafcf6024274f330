"""bench/reliability/run.py's requests: what is sent, how a client gives up on it, and what
came back.

A `RequestSpec` is one distinct greedy request (chat or completions, a prompt, max_tokens); the
churn and the soak draw from a fixed set of them, so every completed request can be compared with
the same spec run alone. A `CancelPlan` says when the client closes its stream: after a number of
chunks (0: right after the response headers, before any chunk) or after a delay from the send
(which may come before the first chunk too).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import time
from typing import Any

import httpx

TOPICS = (
    "the ocean", "a lighthouse keeper", "prime numbers", "the Roman empire", "photosynthesis",
    "a broken clock", "coffee", "binary search", "mountains in winter", "a friendly robot",
    "the moon landing", "bread baking", "jazz music", "volcanoes", "a lost key", "chess openings",
    "rainforests", "the printing press", "a city at night", "hash tables", "honeybees",
    "electric cars", "an old library", "the water cycle", "origami", "black holes",
)  # fmt: skip
CHAT_TEMPLATES = (
    "Write a short poem about {}.",
    "Explain {} to a ten-year-old in three sentences.",
    "Give me three facts about {}.",
    "Tell a very short story about {}.",
    "What is the most surprising thing about {}? Answer briefly.",
    "List five words that remind you of {}.",
)
COMPLETION_TEMPLATES = (
    "Here is a short essay about {}.\n\n",
    "Q: What do you know about {}?\nA:",
    "The first thing to understand about {} is",
    "Notes on {}:\n1.",
)


@dataclasses.dataclass(frozen=True)
class RequestSpec:
    """One distinct greedy streaming request."""

    kind: str  # "chat" or "completion"
    prompt: str
    max_tokens: int

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.kind == "chat" else "/v1/completions"

    def body(self, model: str) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model,
            "temperature": 0,
            "max_tokens": self.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.kind == "chat":
            body["messages"] = [{"role": "user", "content": self.prompt}]
        else:
            body["prompt"] = self.prompt
        return body


@dataclasses.dataclass(frozen=True)
class CancelPlan:
    """When the client closes the stream: after `num_chunks` chunks, or `delay` seconds after
    it sent the request (whichever is set)."""

    num_chunks: int | None = None
    delay: float | None = None


@dataclasses.dataclass(frozen=True)
class StreamResult:
    """What one streamed request got. `outcome`: "completed" (it reached [DONE] with a finish
    reason), "cancelled" (the client closed it first) or "error" (`error` says what)."""

    spec_index: int
    outcome: str
    text: str = ""
    num_chunks: int = 0
    num_completion_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    seconds: float = 0.0


def make_specs(
    num_specs: int, max_tokens: tuple[int, int], rng: random.Random
) -> list[RequestSpec]:
    """`num_specs` distinct requests, chat and completions alternating, prompts and max_tokens
    drawn from `rng` (max_tokens uniform in the closed range)."""
    most = 2 * len(TOPICS) * len(COMPLETION_TEMPLATES)  # distinct prompts, the kinds alternating
    if num_specs > most:
        raise ValueError(f"at most {most} distinct requests, not {num_specs}")
    specs: list[RequestSpec] = []
    while len(specs) < num_specs:
        kind = "chat" if len(specs) % 2 == 0 else "completion"
        templates = CHAT_TEMPLATES if kind == "chat" else COMPLETION_TEMPLATES
        spec = RequestSpec(kind, rng.choice(templates).format(rng.choice(TOPICS)), 0)
        if all((s.kind, s.prompt) != (spec.kind, spec.prompt) for s in specs):
            specs.append(dataclasses.replace(spec, max_tokens=rng.randint(*max_tokens)))
    return specs


def draw_cancel(rng: random.Random, fraction: float, max_delay: float) -> CancelPlan | None:
    """None (let it finish) with probability 1 - fraction; else half the plans cut after 0-8
    chunks (0: before the first), half after a delay uniform in [0, max_delay] seconds."""
    if rng.random() >= fraction:
        return None
    if rng.random() < 0.5:
        return CancelPlan(num_chunks=rng.randint(0, 8))
    return CancelPlan(delay=rng.uniform(0.0, max_delay))


class _Cancelled(Exception):
    """The client's plan says: close the stream now."""


async def stream_one(
    client: httpx.AsyncClient,
    spec: RequestSpec,
    spec_index: int,
    model: str,
    plan: CancelPlan | None = None,
) -> StreamResult:
    """Send `spec` streamed and read it to [DONE], or close it as `plan` says. Closing the
    response (leaving `client.stream`) drops the connection, which the server sees as a
    disconnect and aborts the request."""
    start = time.perf_counter()
    state: dict[str, Any] = {"text": [], "num_chunks": 0, "tokens": None, "finish": None}

    async def read() -> StreamResult:
        async with client.stream("POST", spec.path, json=spec.body(model)) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                raise RuntimeError(f"HTTP {response.status_code}: {text[:300]}")
            if plan is not None and plan.num_chunks == 0:
                raise _Cancelled
            is_done = False
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    is_done = True
                    break
                _feed(state, json.loads(line[6:]), spec.kind)
                if plan is not None and plan.num_chunks == state["num_chunks"]:
                    raise _Cancelled
        if not is_done:
            raise RuntimeError("the stream ended without [DONE]")
        if state["finish"] not in ("stop", "length"):
            raise RuntimeError(f"finish_reason {state['finish']!r}")
        return _result(spec_index, "completed", state, start)

    try:
        if plan is not None and plan.delay is not None:
            return await asyncio.wait_for(read(), plan.delay)
        return await read()
    except (_Cancelled, TimeoutError):
        return _result(spec_index, "cancelled", state, start)
    except Exception as e:  # noqa: BLE001 - every failure is counted and reported
        return dataclasses.replace(
            _result(spec_index, "error", state, start), error=f"{type(e).__name__}: {e}"[:400]
        )


def _feed(state: dict[str, Any], chunk: dict[str, Any], kind: str) -> None:
    if "error" in chunk:
        raise RuntimeError(f"error event: {json.dumps(chunk['error'])[:300]}")
    if chunk.get("usage"):
        state["tokens"] = chunk["usage"]["completion_tokens"]
    for choice in chunk.get("choices") or []:
        piece = (choice.get("delta") or {}).get("content") if kind == "chat" else choice["text"]
        state["text"].append(piece or "")
        if choice.get("finish_reason"):
            state["finish"] = choice["finish_reason"]
    if chunk.get("choices"):
        state["num_chunks"] += 1


def _result(spec_index: int, outcome: str, state: dict[str, Any], start: float) -> StreamResult:
    return StreamResult(
        spec_index=spec_index,
        outcome=outcome,
        text="".join(state["text"]),
        num_chunks=state["num_chunks"],
        num_completion_tokens=state["tokens"],
        finish_reason=state["finish"],
        seconds=time.perf_counter() - start,
    )
