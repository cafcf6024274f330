"""Operator-only routes, under /internal/: not part of the OpenAI API.

`GET /internal/engine-check` runs the block manager's integrity check on the engine thread,
between two steps (`AsyncEngine.call`), and answers its counts: 200 with `"ok": true`, or 500
with `"ok": false` and the broken invariant. bench/reliability/ asks it after its churn, soak
and fuzz; an operator can ask it of a live server.

`GET /internal/speculation` answers the policy's mode; `PUT` with `{"mode": "off" | "always" |
"auto"}` switches it from the next step on, keeping what the policy has learned (auto only where
the server started in auto: it needs the step-time model calibrated then). An operator can turn
speculation off without a restart; bench/policy/ compares the modes on one warm server.
`POST /internal/reset-prefix-cache` forgets the cached prefixes no request holds (as vLLM's
`/reset_prefix_cache`), so that a measurement starts from a cold cache.

These routes answer only behind an API key. With `api_key` set, the key middleware guards
/internal/ like every non-public path; without one there is no way to tell an operator from
anyone else, so they answer 404 as if they did not exist. The check costs O(blocks) on the engine
thread, which is not something to hand to every client.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from engine.engine import LLMEngine
from server.async_engine import AsyncEngine, EngineDeadError
from server.errors import engine_unavailable, invalid_request, not_found
from server.state import server_state

logger = logging.getLogger(__name__)
T = TypeVar("T")

admin_router = APIRouter(prefix="/internal")


@dataclass(frozen=True)
class EngineCheck:
    """The engine's bookkeeping at one instant, and whether it is consistent."""

    ok: bool
    error: str | None
    num_kv_blocks: int
    num_free_kv_blocks: int  # allocatable now: cached (evictable) blocks included
    num_cached_kv_blocks: int
    num_used_kv_blocks: int
    num_running: int
    num_waiting: int
    num_unfinished: int


def check_engine(engine: LLMEngine) -> EngineCheck:
    """Run on the engine thread: the counts, then `check_integrity` (an AssertionError names the
    invariant that does not hold)."""
    blocks = engine.block_manager
    error = None
    try:
        blocks.check_integrity()
    except AssertionError as e:
        error = str(e) or "the block manager's integrity check failed"
    return EngineCheck(
        ok=error is None,
        error=error,
        num_kv_blocks=blocks.num_blocks,
        num_free_kv_blocks=blocks.num_free_blocks,
        num_cached_kv_blocks=blocks.num_cached_blocks,
        num_used_kv_blocks=blocks.num_used_blocks,
        num_running=len(engine.scheduler.running),
        num_waiting=len(engine.scheduler.waiting),
        num_unfinished=engine.num_unfinished_requests,
    )


def _operator_engine(request: Request) -> AsyncEngine:
    """The live engine, for a request that came with the API key (404 where there is none)."""
    state = server_state(request.app)
    if not state.settings.api_key:
        raise not_found(f"No route {request.method} {request.url.path}.")
    engine = state.async_engine
    if engine is None or not engine.is_alive:
        raise engine_unavailable()
    return engine


async def _on_engine_thread(request: Request, fn: Callable[[LLMEngine], T]) -> T:
    try:
        return await _operator_engine(request).call(fn)
    except EngineDeadError:
        raise engine_unavailable() from None


@admin_router.get("/engine-check")
async def engine_check(request: Request) -> Response:
    check = await _on_engine_thread(request, check_engine)
    if not check.ok:
        logger.error("engine check failed: %s", check.error)
    return JSONResponse(asdict(check), status_code=200 if check.ok else 500)


@admin_router.get("/speculation")
async def speculation_mode(request: Request) -> Response:
    mode = await _on_engine_thread(request, lambda engine: engine.speculation_mode)
    return JSONResponse({"mode": mode})


@admin_router.put("/speculation")
async def set_speculation_mode(request: Request) -> Response:
    _operator_engine(request)  # 404 / 503 before the body is read
    try:
        body = await request.json()
    except ValueError:
        raise invalid_request('The body must be a JSON object such as {"mode": "off"}.') from None
    mode = body.get("mode") if isinstance(body, dict) else None
    mode = mode if isinstance(mode, str) else ""  # anything else: not one of the modes

    def switch(engine: LLMEngine) -> str | None:  # checked there: one list of modes
        try:
            engine.set_speculation_mode(mode)
        except ValueError as e:
            return str(e)
        return None

    error = await _on_engine_thread(request, switch)
    if error is not None:
        raise invalid_request(error, param="mode")
    logger.info("speculation mode set to %s", mode)
    return JSONResponse({"mode": mode})


@admin_router.post("/reset-prefix-cache")
async def reset_prefix_cache(request: Request) -> Response:
    num_blocks = await _on_engine_thread(request, lambda engine: engine.reset_prefix_cache())
    return JSONResponse({"num_dropped_blocks": num_blocks})
