"""AsyncEngine on a tiny model: parity with the offline engine under concurrency, every delta
delivered to a slow consumer, validation before the first output, and disconnects that free
every block."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import threading

import pytest

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.speculative_config import SpeculativeConfig
from server.async_engine import AsyncEngine
from tests.conftest import TINY_VOCAB
from tests.unit.async_helpers import (
    CONFIG,
    GREEDY,
    assert_stream_consistent,
    collect,
    idle_state,
    make_engine,
    offline,
    prompt_of,
    run,
    whole,
)


def test_concurrent_generate_matchesoffline(tiny_llama):
    prompts = [prompt_of(i) for i in range(6)]
    sampled = SamplingParams(n=2, temperature=0.9, seed=11, max_tokens=8, ignore_eos=True)
    expected = offline(tiny_llama, prompts, GREEDY) + offline(tiny_llama, prompts[:1], sampled)

    async def main():
        ae = AsyncEngine(make_engine(tiny_llama))
        ae.start()
        calls = [collect(ae, f"g{i}", p, GREEDY) for i, p in enumerate(prompts)]
        calls.append(collect(ae, "sampled", prompts[0], sampled))
        results = await asyncio.gather(*calls)
        await ae.shutdown(timeout=5)
        return results

    results = run(main())
    for outs, want in zip(results, expected, strict=True):
        assert_stream_consistent(outs)
        final = whole(outs)
        assert [c.token_ids for c in final.outputs] == [c.token_ids for c in want.outputs]
        assert all(c.finish_reason == "length" for c in final.outputs)
        assert final.prompt_token_ids == want.prompt_token_ids
    sampled_final = whole(results[-1]).outputs
    assert sampled_final[0].token_ids != sampled_final[1].token_ids  # n=2 really sampled twice


def test_slow_consumer_sees_every_delta(tiny_llama):
    async def main():
        ae = AsyncEngine(make_engine(tiny_llama))
        ae.start()
        gen = ae.generate("slow", prompt_of(1), GREEDY)
        outs = [await anext(gen)]
        as_received = copy.deepcopy(outs[0])
        while await ae.call(lambda e: e.has_unfinished_requests()):
            await asyncio.sleep(0.01)  # the engine runs ahead of this consumer to the end
        outs += [out async for out in gen]
        await ae.shutdown(timeout=5)
        return outs, as_received

    outs, as_received = run(main())
    assert len(outs) == GREEDY.max_tokens  # one output per decoded token, none merged or lost
    assert outs[0] == as_received  # handed over without a copy, and never changed after
    assert all(len(o.outputs[0].token_ids) == 1 for o in outs)
    assert_stream_consistent(outs)
    assert (
        whole(outs).outputs[0].token_ids
        == offline(tiny_llama, [prompt_of(1)], GREEDY)[0].outputs[0].token_ids
    )


def test_streamed_deltas_add_up_to_the_offline_output_under_speculation(tiny_llama):
    ngram = SpeculativeConfig("ngram", mode="always", num_speculative_tokens=3, prompt_lookup_min=1)
    spec = {**CONFIG, "speculative_config": ngram}
    params = SamplingParams(n=2, temperature=0, max_tokens=40, logprobs=1, ignore_eos=True)
    prompt = [7, 8, 9, 10, 11] * 6  # repetitive: drafts are accepted, steps add several tokens

    async def main():
        ae = AsyncEngine(LLMEngine(EngineConfig(model=str(tiny_llama), **spec)))
        ae.start()
        outs = await collect(ae, "spec", prompt, params)
        await ae.shutdown(timeout=5)
        return outs

    outs = run(main())
    assert_stream_consistent(outs)
    assert max(len(o.outputs[0].token_ids) for o in outs) > 1
    streamed = whole(outs)
    (want,) = LLM(str(tiny_llama), **spec).generate([prompt], params)
    for got, expected in zip(streamed.outputs, want.outputs, strict=True):
        assert got.token_ids == expected.token_ids
        assert got.logprobs == expected.logprobs
        assert got.finish_reason == expected.finish_reason == "length"
        assert got.spec_stats.num_accepted_tokens == expected.spec_stats.num_accepted_tokens > 0


def test_bad_input_raises_before_any_output(tiny_llama):
    dup_params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)

    async def main():
        ae = AsyncEngine(make_engine(tiny_llama))
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
        gen = ae.generate("dup", prompt_of(2), dup_params)
        first = await anext(gen)
        with pytest.raises(ValueError, match="already in use"):
            await anext(ae.generate("dup", prompt_of(3), GREEDY))
        # A duplicate whose caller leaves before the verdict must not abort the original either.
        gate = threading.Event()
        paused = asyncio.ensure_future(ae.call(lambda e: gate.wait(30)))
        leaving = asyncio.ensure_future(anext(ae.generate("dup", prompt_of(3), GREEDY)))
        await asyncio.sleep(0.05)
        leaving.cancel()
        gate.set()
        assert await paused
        rest = [out async for out in gen]  # the original is untouched by the rejected duplicate
        state = await idle_state(ae)
        await ae.shutdown(timeout=5)
        return [first, *rest], state

    outs, state = run(main())
    assert_stream_consistent(outs)
    want = offline(tiny_llama, [prompt_of(2)], dup_params)[0].outputs[0].token_ids
    assert whole(outs).outputs[0].token_ids == want
    assert outs[-1].outputs[0].finish_reason == "length"
    assert state == (0, 0, 0, False)


def test_cancelled_generations_free_everything(tiny_llama):
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)

    async def close_after(ae: AsyncEngine, i: int, num_outputs: int) -> int:
        n = 0
        async with contextlib.aclosing(ae.generate(f"c{i}", prompt_of(i), params)) as gen:
            async for _ in gen:
                n += 1
                if n == num_outputs:
                    break
        return n

    async def run_until(ae: AsyncEngine, i: int, num_outputs: int, reached: asyncio.Event):
        n = 0
        async for _ in ae.generate(f"c{i}", prompt_of(i), params):
            n += 1
            if n >= num_outputs:
                reached.set()

    async def main():
        ae = AsyncEngine(make_engine(tiny_llama))  # max_num_seqs 16: most of the 50 start waiting
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
        state = await idle_state(ae)
        counts = (ae.num_waiting, ae.num_running)
        after = await collect(ae, "after", prompt_of(3), GREEDY)
        await ae.shutdown(timeout=5)
        return num_read, [t.cancelled() for t, _ in cancels], state, counts, after

    num_read, cancelled, state, counts, after = run(main())
    assert num_read == [1 + i % 3 for i in range(0, 50, 2)]
    assert all(cancelled)
    assert state == (0, 0, 0, False)
    assert counts == (0, 0)
    assert_stream_consistent(after)
    want = offline(tiny_llama, [prompt_of(3)], GREEDY)[0].outputs[0].token_ids
    assert whole(after).outputs[0].token_ids == want


def test_a_steps_outputs_reach_their_loop_in_one_wake_up(tiny_llama):
    """Every output of a step for streams of one event loop is handed over in one
    call_soon_threadsafe (one self-pipe write a step, not one a stream): at most one wake-up a
    step however many streams decode, and every delta still arrives in order."""
    prompts = [prompt_of(i) for i in range(6)]
    expected = offline(tiny_llama, prompts, GREEDY)

    async def main():
        loop = asyncio.get_running_loop()
        wakeups = 0
        original = loop.call_soon_threadsafe

        def counted(*args, **kwargs):
            nonlocal wakeups
            # Outputs only (a `call`'s future is settled the same way).
            if getattr(args[0], "__name__", "") == "_put_items":
                wakeups += 1
            return original(*args, **kwargs)

        loop.call_soon_threadsafe = counted
        ae = AsyncEngine(make_engine(tiny_llama))
        ae.start()
        results = await asyncio.gather(
            *(collect(ae, f"g{i}", p, GREEDY) for i, p in enumerate(prompts))
        )
        steps = await ae.call(lambda engine: engine.metrics.num_steps)
        await ae.shutdown(timeout=5)
        return results, wakeups, steps

    results, wakeups, steps = run(main())
    for outs, want in zip(results, expected, strict=True):
        assert_stream_consistent(outs)
        assert [c.token_ids for c in whole(outs).outputs] == [c.token_ids for c in want.outputs]
    num_outputs = sum(len(outs) for outs in results)
    assert wakeups <= steps < num_outputs
