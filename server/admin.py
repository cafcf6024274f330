"""Operator-only routes, under /internal/: not part of the OpenAI API.

`GET /internal/engine-check` runs the block manager's integrity check on the engine thread,
between two steps (`AsyncEngine.call`), and answers its counts: 200 with `"ok": true`, or 500
with `"ok": false` and the broken invariant. bench/reliability.py asks it after its churn, soak
and fuzz; an operator can ask it of a live server.

These routes answer only behind an API key. With `api_key` set, the key middleware guards
/internal/ like every non-public path; without one there is no way to tell an operator from
anyone else, so they answer 404 as if they did not exist. The check costs O(blocks) on the engine
thread, which is not something to hand to every client.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from engine.engine import LLMEngine
from server.async_engine import AsyncEngine, EngineDeadError
from server.errors import not_found
from server.streaming import engine_unavailable

logger = logging.getLogger(__name__)

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


@admin_router.get("/engine-check")
async def engine_check(request: Request) -> Response:
    state = request.app.state
    if not state.settings.api_key:
        raise not_found(f"No route GET {request.url.path}.")
    engine: AsyncEngine | None = state.async_engine
    if engine is None or not engine.is_alive:
        raise engine_unavailable()
    try:
        check = await engine.call(check_engine)
    except EngineDeadError:
        raise engine_unavailable() from None
    if not check.ok:
        logger.error("engine check failed: %s", check.error)
    return JSONResponse(asdict(check), status_code=200 if check.ok else 500)
