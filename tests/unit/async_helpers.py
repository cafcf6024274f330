"""What the AsyncEngine tests share: a tiny engine, prompts, a deadline, and the checks on the
outputs a stream hands over."""

from __future__ import annotations

import asyncio

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.outputs import OutputAccumulator, RequestOutput
from server.async_engine import AsyncEngine
from tests.conftest import TINY_VOCAB

CONFIG = dict(dtype="float32", block_size=4, num_kv_blocks=256, max_model_len=256)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
DEADLINE_S = 30
LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)


def run(main):
    """asyncio.run with a deadline: a bug that leaves a caller waiting fails instead of hanging."""
    return asyncio.run(asyncio.wait_for(main, DEADLINE_S))


def make_engine(model_path, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_path), **{**CONFIG, **overrides}))


def offline(model_path, prompts, params) -> list[RequestOutput]:
    return LLM(str(model_path), **CONFIG).generate(prompts, params)


def prompt_of(i: int) -> list[int]:
    return [(7 * i + j * 13) % (TINY_VOCAB - 3) + 3 for j in range(3 + i % 5)]


async def collect(ae: AsyncEngine, request_id: str, prompt, params) -> list[RequestOutput]:
    return [out async for out in ae.generate(request_id, prompt, params)]


def whole(outs: list[RequestOutput]) -> RequestOutput:
    """A stream's outputs added up: what the offline API returns for the request."""
    accumulator = OutputAccumulator()
    wholes = [w for o in outs if (w := accumulator.add(o)) is not None]
    assert len(wholes) == 1
    return wholes[0]


def assert_stream_consistent(outs: list[RequestOutput]) -> None:
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


async def idle_state(ae: AsyncEngine) -> tuple[int, int, int, bool]:
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
