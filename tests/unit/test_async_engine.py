"""AsyncEngine on a tiny model: parity with the offline engine under concurrency, validation
before the first output, disconnects that free every block, overload, shutdown, a dying loop,
and an idle loop that does not spin."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import threading
import time

import pytest

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.outputs import OutputAccumulator, RequestOutput
from server.async_engine import AsyncEngine, EngineDeadError, QueueFullError
from tests.conftest import TINY_VOCAB

_CONFIG = dict(dtype="float32", block_size=4, num_kv_blocks=256, max_model_len=256)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
_DEADLINE_S = 30
LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)


def _run(main):
    """asyncio.run with a deadline: a bug that leaves a caller waiting fails instead of hanging."""
    return asyncio.run(asyncio.wait_for(main, _DEADLINE_S))


def _engine(model_path, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_path), **{**_CONFIG, **overrides}))


def _offline(model_path, prompts, params) -> list[RequestOutput]:
    return LLM(str(model_path), **_CONFIG).generate(prompts, params)


def _prompt(i: int) -> list[int]:
    return [(7 * i + j * 13) % (TINY_VOCAB - 3) + 3 for j in range(3 + i % 5)]


async def _collect(ae: AsyncEngine, request_id: str, prompt, params) -> list[RequestOutput]:
    return [out async for out in ae.generate(request_id, prompt, params)]


def _whole(outs: list[RequestOutput]) -> RequestOutput:
    """A stream's outputs added up: what the offline API returns for the request."""
    accumulator = OutputAccumulator()
    wholes = [w for o in outs if (w := accumulator.add(o)) is not None]
    assert len(wholes) == 1
    return wholes[0]


def _assert_stream_consistent(outs: list[RequestOutput]) -> None:
    """Only the last output is finished, and every completion's outputs each carry exactly the
    tokens their step added: none lost, merged or repeated."""
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    for i in range(len(outs[-1].outputs)):
        num_tokens = 0
        for o in outs:
            num_tokens += len(o.outputs[i].token_ids)
            assert o.outputs[i].num_output_tokens == num_tokens
            if o.outputs[i].logprobs is not None:
                assert [e.token_id for e in o.outputs[i].logprobs] == o.outputs[i].token_ids


async def _idle_state(ae: AsyncEngine) -> tuple[int, int, int, bool]:
    def state(engine: LLMEngine) -> tuple[int, int, int, bool]:
        engine.block_manager.check_integrity()
        scheduler = engine.scheduler
        return (
            len(scheduler.waiting),
            len(scheduler.running),
            engine.block_manager.num_used_blocks,
            engine.has_unfinished_requests(),
        )

    return await ae.call(state)


def test_concurrent_generate_matches_offline(tiny_llama):
    prompts = [_prompt(i) for i in range(6)]
    sampled = SamplingParams(n=2, temperature=0.9, seed=11, max_tokens=8, ignore_eos=True)
    expected = _offline(tiny_llama, prompts, GREEDY) + _offline(tiny_llama, prompts[:1], sampled)

    async def main():
        ae = AsyncEngine(_engine(tiny_llama))
        ae.start()
        calls = [_collect(ae, f"g{i}", p, GREEDY) for i, p in enumerate(prompts)]
        calls.append(_collect(ae, "sampled", prompts[0], sampled))
        results = await asyncio.gather(*calls)
        await ae.shutdown(timeout=5)
        return results

    results = _run(main())
    for outs, want in zip(results, expected, strict=True):
        _assert_stream_consistent(outs)
        final = _whole(outs)
        assert [c.token_ids for c in final.outputs] == [c.token_ids for c in want.outputs]
        assert all(c.finish_reason == "length" for c in final.outputs)
        assert final.prompt_token_ids == want.prompt_token_ids
    sampled_final = _whole(results[-1]).outputs
    assert sampled_final[0].token_ids != sampled_final[1].token_ids  # n=2 really sampled twice


def test_slow_consumer_sees_every_delta(tiny_llama):
    async def main():
        ae = AsyncEngine(_engine(tiny_llama))
        ae.start()
        gen = ae.generate("slow", _prompt(1), GREEDY)
        outs = [await anext(gen)]
        as_received = copy.deepcopy(outs[0])
        while await ae.call(lambda e: e.has_unfinished_requests()):
            await asyncio.sleep(0.01)  # the engine runs ahead of this consumer to the end
        outs += [out async for out in gen]
        await ae.shutdown(timeout=5)
        return outs, as_received

    outs, as_received = _run(main())
    assert len(outs) == GREEDY.max_tokens  # one output per decoded token, none merged or lost
    assert outs[0] == as_received  # handed over without a copy, and never changed after
    assert all(len(o.outputs[0].token_ids) == 1 for o in outs)
    _assert_stream_consistent(outs)
    assert (
        _whole(outs).outputs[0].token_ids
        == _offline(tiny_llama, [_prompt(1)], GREEDY)[0].outputs[0].token_ids
    )


def test_streamed_deltas_add_up_to_the_offline_output_under_speculation(tiny_llama):
    ngram = dict(method="ngram", mode="always", num_speculative_tokens=3, prompt_lookup_min=1)
    spec = {**_CONFIG, "speculative_config": ngram}
    params = SamplingParams(n=2, temperature=0, max_tokens=40, logprobs=1, ignore_eos=True)
    prompt = [7, 8, 9, 10, 11] * 6  # repetitive: drafts are accepted, steps add several tokens

    async def main():
        ae = AsyncEngine(LLMEngine(EngineConfig(model=str(tiny_llama), **spec)))
        ae.start()
        outs = await _collect(ae, "spec", prompt, params)
        await ae.shutdown(timeout=5)
        return outs

    outs = _run(main())
    _assert_stream_consistent(outs)
    assert max(len(o.outputs[0].token_ids) for o in outs) > 1
    streamed = _whole(outs)
    (want,) = LLM(str(tiny_llama), **spec).generate([prompt], params)
    for got, expected in zip(streamed.outputs, want.outputs, strict=True):
        assert got.token_ids == expected.token_ids
        assert got.logprobs == expected.logprobs
        assert got.finish_reason == expected.finish_reason == "length"
        assert got.spec_stats.num_accepted_tokens == expected.spec_stats.num_accepted_tokens > 0


def test_bad_input_raises_before_any_output(tiny_llama):
    dup_params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)

    async def main():
        ae = AsyncEngine(_engine(tiny_llama))
        ae.start()
        bad = [
            ([TINY_VOCAB + 5], GREEDY, "outside the vocabulary"),
            ([], GREEDY, "empty"),
            ("text", GREEDY, "no tokenizer"),
            ([3, 4], SamplingParams(max_tokens=1000), "exceeds this model's context"),
        ]
        for prompt, params, message in bad:
            with pytest.raises(ValueError, match=message):
                await anext(ae.generate("bad", prompt, params))
        gen = ae.generate("dup", _prompt(2), dup_params)
        first = await anext(gen)
        with pytest.raises(ValueError, match="already in use"):
            await anext(ae.generate("dup", _prompt(3), GREEDY))
        # A duplicate whose caller leaves before the verdict must not abort the original either.
        gate = threading.Event()
        paused = asyncio.ensure_future(ae.call(lambda e: gate.wait(30)))
        leaving = asyncio.ensure_future(anext(ae.generate("dup", _prompt(3), GREEDY)))
        await asyncio.sleep(0.05)
        leaving.cancel()
        gate.set()
        assert await paused
        rest = [out async for out in gen]  # the original is untouched by the rejected duplicate
        state = await _idle_state(ae)
        await ae.shutdown(timeout=5)
        return [first, *rest], state

    outs, state = _run(main())
    _assert_stream_consistent(outs)
    want = _offline(tiny_llama, [_prompt(2)], dup_params)[0].outputs[0].token_ids
    assert _whole(outs).outputs[0].token_ids == want
    assert outs[-1].outputs[0].finish_reason == "length"
    assert state == (0, 0, 0, False)


def test_cancelled_generations_free_everything(tiny_llama):
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)

    async def close_after(ae: AsyncEngine, i: int, num_outputs: int) -> int:
        n = 0
        async with contextlib.aclosing(ae.generate(f"c{i}", _prompt(i), params)) as gen:
            async for _ in gen:
                n += 1
                if n == num_outputs:
                    break
        return n

    async def run_until(ae: AsyncEngine, i: int, num_outputs: int, reached: asyncio.Event):
        n = 0
        async for _ in ae.generate(f"c{i}", _prompt(i), params):
            n += 1
            if n >= num_outputs:
                reached.set()

    async def main():
        ae = AsyncEngine(_engine(tiny_llama))  # max_num_seqs 16: most of the 50 start waiting
        ae.start()
        closers, cancels = [], []
        for i in range(50):
            if i % 2 == 0:  # the consumer stops iterating: aclose()
                closers.append(asyncio.create_task(close_after(ae, i, 1 + i % 3)))
            else:  # the consumer's task is cancelled, some before their first output
                reached = asyncio.Event()
                task = asyncio.create_task(run_until(ae, i, i % 4, reached))
                cancels.append((task, reached))
        await asyncio.sleep(0)
        for task, reached in cancels:
            await asyncio.wait_for(reached.wait(), timeout=60)
            task.cancel()
        num_read = await asyncio.gather(*closers)
        await asyncio.gather(*(task for task, _ in cancels), return_exceptions=True)
        state = await _idle_state(ae)
        counts = (ae.num_waiting, ae.num_running)
        after = await _collect(ae, "after", _prompt(3), GREEDY)
        await ae.shutdown(timeout=5)
        return num_read, [t.cancelled() for t, _ in cancels], state, counts, after

    num_read, cancelled, state, counts, after = _run(main())
    assert num_read == [1 + i % 3 for i in range(0, 50, 2)]
    assert all(cancelled)
    assert state == (0, 0, 0, False)
    assert counts == (0, 0)
    _assert_stream_consistent(after)
    want = _offline(tiny_llama, [_prompt(3)], GREEDY)[0].outputs[0].token_ids
    assert _whole(after).outputs[0].token_ids == want


def test_queue_full_rejects_while_admitted_ones_complete(tiny_llama):
    prompts = [_prompt(i) for i in range(8)]
    expected = [o.outputs[0].token_ids for o in _offline(tiny_llama, prompts, GREEDY)]

    async def fill_while_paused(ae: AsyncEngine, ids: range) -> list[list[RequestOutput]]:
        gate = threading.Event()
        paused = asyncio.ensure_future(ae.call(lambda e: gate.wait(30)))  # holds the thread
        tasks = [asyncio.create_task(_collect(ae, f"q{i}", prompts[i], GREEDY)) for i in ids]
        await asyncio.sleep(0.05)  # every task has asked for admission
        with pytest.raises(QueueFullError):
            await anext(ae.generate("one-too-many", prompts[0], GREEDY))
        assert ae.is_ready
        gate.set()
        assert await paused
        return await asyncio.gather(*tasks)

    async def main():
        ae = AsyncEngine(_engine(tiny_llama, max_num_seqs=2), max_queue=4)
        ae.start()
        first = await fill_while_paused(ae, range(4))
        # Exactly max_queue again: the admission count went back to zero, not off by one.
        second = await fill_while_paused(ae, range(4, 8))
        await ae.shutdown(timeout=5)
        return first + second

    for outs, want in zip(_run(main()), expected, strict=True):
        _assert_stream_consistent(outs)
        assert _whole(outs).outputs[0].token_ids == want


def test_abort_ends_the_stream(tiny_llama):
    async def main():
        ae = AsyncEngine(_engine(tiny_llama, max_num_seqs=1))
        ae.start()
        running = ae.generate("running", _prompt(1), LONG)
        first = await anext(running)
        queued = ae.generate("queued", _prompt(2), LONG)
        queued_task = asyncio.ensure_future(anext(queued))
        await asyncio.sleep(0.05)
        assert await ae.abort("queued")  # still waiting: max_num_seqs is 1
        assert await ae.abort("running")
        assert not await ae.abort("running")
        rest = [out async for out in running]
        queued_out = await queued_task
        with pytest.raises(StopAsyncIteration):
            await anext(queued)
        state = await _idle_state(ae)
        await ae.shutdown(timeout=5)
        return [first, *rest], queued_out, state

    outs, queued_out, state = _run(main())
    _assert_stream_consistent(outs)
    assert outs[-1].outputs[0].finish_reason == "abort"
    assert 0 < len(_whole(outs).outputs[0].token_ids) < LONG.max_tokens
    assert queued_out.finished and queued_out.outputs[0].finish_reason == "abort"
    assert queued_out.prompt_token_ids == _prompt(2) and queued_out.outputs[0].token_ids == []
    assert state == (0, 0, 0, False)


def test_shutdown_drains_then_aborts(tiny_llama):
    engine = _engine(tiny_llama)
    step = engine.step

    def slow_step():
        time.sleep(0.02)  # LONG needs 200 steps: far past the shutdown timeout
        return step()

    engine.step = slow_step
    short = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)

    async def main():
        ae = AsyncEngine(engine)
        ae.start()
        gens = [ae.generate(f"s{i}", _prompt(i), short) for i in range(2)]
        gens += [ae.generate(f"l{i}", _prompt(i + 2), LONG) for i in range(2)]
        firsts = [await anext(g) for g in gens]  # all admitted and running
        tasks = [asyncio.create_task(_rest(g, f)) for g, f in zip(gens, firsts, strict=True)]
        start = time.monotonic()
        await ae.shutdown(timeout=1.5)
        elapsed = time.monotonic() - start
        with pytest.raises(EngineDeadError, match="shutting down"):
            await anext(ae.generate("late", _prompt(0), short))
        return await asyncio.gather(*tasks), elapsed, ae.is_alive, ae.is_ready

    results, elapsed, is_alive, is_ready = _run(main())
    # The long requests cannot end before the deadline (200 steps of 20 ms), so shutdown waited
    # it out; no upper bound: on a loaded machine the drain may take any time.
    assert elapsed >= 1.5
    assert not is_alive and not is_ready
    want = _offline(tiny_llama, [_prompt(0), _prompt(1)], short)
    for outs, ref in zip(results[:2], want, strict=True):  # drained within the timeout
        _assert_stream_consistent(outs)
        assert _whole(outs).outputs[0].token_ids == ref.outputs[0].token_ids
        assert outs[-1].outputs[0].finish_reason == "length"
    for outs in results[2:]:  # still running at the deadline: aborted
        _assert_stream_consistent(outs)
        assert outs[-1].outputs[0].finish_reason == "abort"
        assert 0 < len(_whole(outs).outputs[0].token_ids) < LONG.max_tokens
    engine.block_manager.check_integrity()  # the thread has stopped: safe to look
    assert engine.block_manager.num_used_blocks == 0 and not engine.has_unfinished_requests()


async def _rest(gen, first: RequestOutput) -> list[RequestOutput]:
    return [first, *[out async for out in gen]]


def test_step_exception_fails_callers_and_marks_dead(tiny_llama, caplog):
    engine = _engine(tiny_llama)
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
        calls = [_collect(ae, f"d{i}", _prompt(i), LONG) for i in range(3)]
        results = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 30)
        with pytest.raises(EngineDeadError, match="boom"):
            await anext(ae.generate("later", _prompt(0), GREEDY))
        with pytest.raises(EngineDeadError):
            await ae.call(lambda e: None)
        aborted = await ae.abort("d0")
        state = (ae.is_alive, ae.is_ready)
        start = time.monotonic()
        await ae.shutdown(timeout=5)
        return results, aborted, state, time.monotonic() - start

    with caplog.at_level(logging.ERROR, logger="server.async_engine"):
        results, aborted, state, shutdown_s = _run(main())
    assert all(isinstance(r, EngineDeadError) for r in results)
    assert all(isinstance(r.__cause__, RuntimeError) for r in results)
    assert not aborted and state == (False, False) and shutdown_s < 1
    assert any(r.exc_info and str(r.exc_info[1]) == "boom" for r in caplog.records)


def test_idle_loop_does_not_spin(tiny_llama):
    async def main():
        ae = AsyncEngine(_engine(tiny_llama))
        ae.start()
        await _collect(ae, "warm", _prompt(0), GREEDY)
        before = await ae.call(lambda e: time.thread_time())
        await asyncio.sleep(0.3)
        after = await ae.call(lambda e: time.thread_time())
        start = time.monotonic()
        await ae.shutdown(timeout=5)
        return after - before, time.monotonic() - start

    cpu_s, shutdown_s = _run(main())
    assert cpu_s < 0.05  # a spinning loop would burn most of the 0.3 s
    assert shutdown_s < 1  # nothing in flight: no waiting for the timeout
