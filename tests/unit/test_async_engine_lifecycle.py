"""AsyncEngine's life cycle on a tiny model: overload, aborts, shutdown, a dying loop, and an
idle loop that does not spin."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest

from engine import SamplingParams
from engine.outputs import RequestOutput
from server.async_engine import AsyncEngine, EngineDeadError, QueueFullError
from tests.unit.async_helpers import (
    GREEDY,
    LONG,
    assert_stream_consistent,
    collect,
    idle_state,
    make_engine,
    offline,
    prompt_of,
    run,
    whole,
)


def test_queue_full_rejects_while_admitted_ones_complete(tiny_llama):
    prompts = [prompt_of(i) for i in range(8)]
    expected = [o.outputs[0].token_ids for o in offline(tiny_llama, prompts, GREEDY)]

    async def fill_while_paused(ae: AsyncEngine, ids: range) -> list[list[RequestOutput]]:
        gate = threading.Event()
        paused = asyncio.ensure_future(ae.call(lambda e: gate.wait(30)))  # holds the thread
        tasks = [asyncio.create_task(collect(ae, f"q{i}", prompts[i], GREEDY)) for i in ids]
        await asyncio.sleep(0.05)  # every task has asked for admission
        with pytest.raises(QueueFullError):
            await anext(ae.generate("one-too-many", prompts[0], GREEDY))
        assert ae.is_ready
        gate.set()
        assert await paused
        return await asyncio.gather(*tasks)

    async def main():
        ae = AsyncEngine(make_engine(tiny_llama, max_num_seqs=2), max_queue=4)
        ae.start()
        first = await fill_while_paused(ae, range(4))
        # Exactly max_queue again: the admission count went back to zero, not off by one.
        second = await fill_while_paused(ae, range(4, 8))
        await ae.shutdown(timeout=5)
        return first + second

    for outs, want in zip(run(main()), expected, strict=True):
        assert_stream_consistent(outs)
        assert whole(outs).outputs[0].token_ids == want


def test_abort_ends_the_stream(tiny_llama):
    async def main():
        ae = AsyncEngine(make_engine(tiny_llama, max_num_seqs=1))
        ae.start()
        running = ae.generate("running", prompt_of(1), LONG)
        first = await anext(running)
        queued = ae.generate("queued", prompt_of(2), LONG)
        queued_task = asyncio.ensure_future(anext(queued))
        await asyncio.sleep(0.05)
        assert await ae.abort("queued")  # still waiting: max_num_seqs is 1
        assert await ae.abort("running")
        assert not await ae.abort("running")
        rest = [out async for out in running]
        queued_out = await queued_task
        with pytest.raises(StopAsyncIteration):
            await anext(queued)
        state = await idle_state(ae)
        await ae.shutdown(timeout=5)
        return [first, *rest], queued_out, state

    outs, queued_out, state = run(main())
    assert_stream_consistent(outs)
    assert outs[-1].outputs[0].finish_reason == "abort"
    assert 0 < len(whole(outs).outputs[0].token_ids) < LONG.max_tokens
    assert queued_out.finished and queued_out.outputs[0].finish_reason == "abort"
    assert queued_out.prompt_token_ids == prompt_of(2) and queued_out.outputs[0].token_ids == []
    assert state == (0, 0, 0, False)


def test_shutdown_drains_then_aborts(tiny_llama):
    engine = make_engine(tiny_llama)
    step = engine.step

    def slow_step():
        time.sleep(0.02)  # LONG needs 200 steps: far past the shutdown timeout
        return step()

    engine.step = slow_step
    short = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)

    async def main():
        ae = AsyncEngine(engine)
        ae.start()
        gens = [ae.generate(f"s{i}", prompt_of(i), short) for i in range(2)]
        gens += [ae.generate(f"l{i}", prompt_of(i + 2), LONG) for i in range(2)]
        firsts = [await anext(g) for g in gens]  # all admitted and running
        tasks = [asyncio.create_task(_rest(g, f)) for g, f in zip(gens, firsts, strict=True)]
        start = time.monotonic()
        await ae.shutdown(timeout=1.5)
        elapsed = time.monotonic() - start
        with pytest.raises(EngineDeadError, match="shutting down"):
            await anext(ae.generate("late", prompt_of(0), short))
        return await asyncio.gather(*tasks), elapsed, ae.is_alive, ae.is_ready

    results, elapsed, is_alive, is_ready = run(main())
    # The long requests cannot end before the deadline (200 steps of 20 ms), so shutdown waited
    # it out; no upper bound: on a loaded machine the drain may take any time.
    assert elapsed >= 1.5
    assert not is_alive and not is_ready
    want = offline(tiny_llama, [prompt_of(0), prompt_of(1)], short)
    for outs, ref in zip(results[:2], want, strict=True):  # drained within the timeout
        assert_stream_consistent(outs)
        assert whole(outs).outputs[0].token_ids == ref.outputs[0].token_ids
        assert outs[-1].outputs[0].finish_reason == "length"
    for outs in results[2:]:  # still running at the deadline: aborted
        assert_stream_consistent(outs)
        assert outs[-1].outputs[0].finish_reason == "abort"
        assert 0 < len(whole(outs).outputs[0].token_ids) < LONG.max_tokens
    engine.block_manager.check_integrity()  # the thread has stopped: safe to look
    assert engine.block_manager.num_used_blocks == 0 and not engine.has_unfinished_requests()


async def _rest(gen, first: RequestOutput) -> list[RequestOutput]:
    return [first, *[out async for out in gen]]


def test_step_exception_fails_callers_and_marks_dead(tiny_llama, caplog):
    engine = make_engine(tiny_llama)
    step, num_steps = engine.step, 0

    def flaky_step():
        nonlocal num_steps
        num_steps += 1
        if num_steps == 3:
            raise RuntimeError("boom")
        return step()

    engine.step = flaky_step

    async def main():
        ae = AsyncEngine(engine)
        ae.start()
        assert ae.is_alive and ae.is_ready
        calls = [collect(ae, f"d{i}", prompt_of(i), LONG) for i in range(3)]
        results = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 30)
        with pytest.raises(EngineDeadError, match="boom"):
            await anext(ae.generate("later", prompt_of(0), GREEDY))
        with pytest.raises(EngineDeadError):
            await ae.call(lambda e: None)
        aborted = await ae.abort("d0")
        state = (ae.is_alive, ae.is_ready)
        start = time.monotonic()
        await ae.shutdown(timeout=5)
        return results, aborted, state, time.monotonic() - start

    with caplog.at_level(logging.ERROR, logger="server.async_engine"):
        results, aborted, state, shutdown_s = run(main())
    assert all(isinstance(r, EngineDeadError) for r in results)
    assert all(isinstance(r.__cause__, RuntimeError) for r in results)
    assert not aborted and state == (False, False) and shutdown_s < 1
    assert any(r.exc_info and str(r.exc_info[1]) == "boom" for r in caplog.records)


def test_idle_loop_does_not_spin(tiny_llama):
    async def main():
        ae = AsyncEngine(make_engine(tiny_llama))
        ae.start()
        await collect(ae, "warm", prompt_of(0), GREEDY)
        before = await ae.call(lambda e: time.thread_time())
        await asyncio.sleep(0.3)
        after = await ae.call(lambda e: time.thread_time())
        start = time.monotonic()
        await ae.shutdown(timeout=5)
        return after - before, time.monotonic() - start

    cpu_s, shutdown_s = run(main())
    assert cpu_s < 0.05  # a spinning loop would burn most of the 0.3 s
    assert shutdown_s < 1  # nothing in flight: no waiting for the timeout
