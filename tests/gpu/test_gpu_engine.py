"""The engine on the device: a seeded request samples the same tokens whatever shares its batch
(its generators live on the device, keyed by position), and aborting requests at every stage
(waiting, mid-prefill, mid-decode, mid-speculation) hands every KV block back."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from engine import LLM, SamplingParams
from engine.core.request import Request
from engine.engine import LLMEngine
from tests.gpu.node import (
    FLASH_BF16,
    MAX_TOKENS,
    PROMPTS,
    TORCH_FP32,
    Trace,
    assert_same_greedy,
    engine_trace,
    needs_device,
)

pytestmark = [pytest.mark.gpu, needs_device]


def _draft_config(draft) -> dict[str, Any]:
    return {
        "method": "draft_model",
        "model": str(draft),
        "num_speculative_tokens": 4,
        "mode": "always",
        "draft_min_confidence": 0.0,
    }


# Float32: in half precision another batch shape may round a probability across the uniform draw
# that picks a token, which would be a numerical difference, not a broken generator.
@pytest.mark.gpu_check("seeded sampling: same tokens in any batch")
@pytest.mark.parametrize("speculation", ["off", "draft_model"])
def test_seeded_request_ignores_its_batch(gpu_target, gpu_draft, device, speculation):
    spec = _draft_config(gpu_draft) if speculation == "draft_model" else None
    kwargs = TORCH_FP32.engine_kwargs(device, speculative_config=spec)
    llm = LLM(str(gpu_target), seed=0, **kwargs)
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=32, ignore_eos=True)
    alone = llm.generate([PROMPTS[2]], seeded)[0].outputs[0].token_ids

    unseeded = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    other_seed = SamplingParams(temperature=0.8, top_k=20, seed=99, max_tokens=40, ignore_eos=True)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    nucleus = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=28, ignore_eos=True)
    # Long prompts are prefilled in chunks while the seeded request decodes.
    mix = llm.generate(
        [PROMPTS[0], PROMPTS[2], PROMPTS[3], PROMPTS[5]], [unseeded, seeded, other_seed, greedy]
    )
    assert mix[1].outputs[0].token_ids == alone
    mix = llm.generate(
        [PROMPTS[4], PROMPTS[6], PROMPTS[7], PROMPTS[2]], [nucleus, unseeded, unseeded, seeded]
    )
    assert mix[3].outputs[0].token_ids == alone
    # Another engine, with another engine seed (which only seeds requests that bring none).
    fresh = LLM(str(gpu_target), seed=5, **kwargs)
    assert fresh.generate([PROMPTS[2]], seeded)[0].outputs[0].token_ids == alone
    # And the draws are real: another seed samples other tokens.
    other = llm.generate([PROMPTS[2]], replace(seeded, seed=4321))[0].outputs[0].token_ids
    assert other != alone
    if spec is not None:
        stats = llm.engine.spec_stats
        assert stats.num_draft_tokens > stats.num_accepted_tokens > 0


def _request(engine: LLMEngine, request_id: str) -> Request:
    return engine._groups[request_id].requests[0]


def _is_mid_prefill(engine: LLMEngine, request_id: str) -> bool:
    # Past its first full page (in the prefix cache once the request is gone), short of the end.
    request = _request(engine, request_id)
    return engine.block_manager.block_size < request.num_computed_tokens < request.num_prompt_tokens


def _is_mid_decode(engine: LLMEngine, request_id: str) -> bool:
    return _request(engine, request_id).num_output_tokens >= 3


def _is_mid_speculation(engine: LLMEngine, request_id: str) -> bool:
    # Verified windows are behind it and its draft model holds KV for its latest drafts.
    request = _request(engine, request_id)
    return request.spec_stats.num_drafts >= 2 and request.spec_stats.num_accepted_tokens > 0


@pytest.mark.gpu_check("no leaked KV block after aborts")
@pytest.mark.parametrize("setup", [TORCH_FP32, FLASH_BF16], ids=lambda s: s.id)
def test_aborts_at_every_stage_leak_no_block(gpu_target, gpu_draft, device, setup):
    setup.require(device)
    spec = _draft_config(gpu_draft)
    kwargs = setup.engine_kwargs(
        device, max_num_seqs=3, max_num_batched_tokens=32, speculative_config=spec
    )
    llm = LLM(str(gpu_target), **kwargs)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    engine.add_request("decode", PROMPTS[2], replace(params, speculate=False))
    engine.add_request("speculation", PROMPTS[1], params)
    engine.add_request("prefill", PROMPTS[4], params)  # 300 tokens: chunks of at most 32
    engine.add_request("waiting", PROMPTS[3], params)  # max_num_seqs=3 keeps it waiting
    engine.step()
    assert _request(engine, "waiting").num_computed_tokens == 0
    assert engine.abort("waiting")
    stages = {
        "prefill": _is_mid_prefill,
        "decode": _is_mid_decode,
        "speculation": _is_mid_speculation,
    }
    for _ in range(100):
        for request_id, is_there in list(stages.items()):
            if is_there(engine, request_id):
                assert engine.abort(request_id)
                del stages[request_id]
        if not stages:
            break
        engine.step()
    assert not stages, f"never reached: {sorted(stages)}"
    assert not engine.abort("decode")  # unknown once aborted
    _assert_idle(engine)

    # The pages the aborted prefill left in the prefix cache serve the same prompt correctly.
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    got = [engine_trace(o.outputs[0]) for o in llm.generate(PROMPTS, greedy)]
    _assert_idle(engine)
    assert engine.scheduler.num_prefix_cache_hits > 0
    fresh = LLM(str(gpu_target), **setup.engine_kwargs(device))
    expected: list[Trace] = [engine_trace(o.outputs[0]) for o in fresh.generate(PROMPTS, greedy)]
    assert_same_greedy(expected, got, setup.tolerance, f"after aborts on {setup.id}")


def _assert_idle(engine: LLMEngine) -> None:
    bm = engine.block_manager
    bm.check_integrity()
    assert bm.num_used_blocks == 0  # every block free or cached
    assert bm.num_free_blocks == bm.num_blocks
    assert not engine.scheduler.has_unfinished
    assert not engine.has_unfinished_requests()
