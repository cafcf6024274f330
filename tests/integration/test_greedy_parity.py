"""Greedy float32 output must equal transformers `generate` token for token, under every
scheduling condition: chunked prefill, preemption, prefix caching on/off, block sizes 1 and 16,
one request at a time vs many at once."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.scheduling.scheduler import Scheduler
from tests.conftest import TINY_VOCAB


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    shared = [rng.randrange(3, TINY_VOCAB) for _ in range(21)]
    prompts = [[rng.randrange(3, TINY_VOCAB) for _ in range(n)] for n in (1, 5, 13, 17, 29, 40)]
    # Two prompts sharing a long prefix with each other, and one repeating another exactly:
    # prefix-cache hits inside one batch.
    prompts += [shared + [11, 12, 13], shared + [14], list(prompts[3])]
    return prompts


PROMPTS = _prompts()
MAX_TOKENS = [24, 9, 17, 24, 5, 12, 24, 20, 11]


def _reference(model_dir) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # the engine runs with ignore_eos
    outputs = []
    with torch.no_grad():
        for prompt, n in zip(PROMPTS, MAX_TOKENS, strict=True):
            ids = model.generate(
                torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0
            )
            outputs.append(ids[0, len(prompt) :].tolist())
    return outputs


@pytest.fixture(scope="module", params=["tiny_llama", "tiny_qwen2"])
def model_and_reference(request):
    model_dir = request.getfixturevalue(request.param)
    return model_dir, _reference(model_dir)


SCENARIOS = {
    "default": dict(),
    "chunked_prefill": dict(max_num_batched_tokens=7),
    "preemption": dict(block_size=4, num_kv_blocks=20, max_model_len=80),
    "no_prefix_caching": dict(enable_prefix_caching=False),
    "block_size_1": dict(block_size=1, num_kv_blocks=800),
    "one_at_a_time": dict(max_num_seqs=1),
}


class _Recorder:
    """Wraps Scheduler.schedule to keep every step's token assignment."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.steps: list[list[tuple[str, int, int]]] = []
        self._schedule = scheduler.schedule
        scheduler.schedule = self  # type: ignore[method-assign]

    def __call__(self, offers=None):
        out = self._schedule(offers)
        self.steps.append(
            [
                (s.request.request_id, s.request.num_computed_tokens, s.num_new_tokens)
                for s in out.scheduled
            ]
        )
        return out


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_matches_transformers(model_and_reference, scenario):
    model_dir, expected = model_and_reference
    llm = LLM(str(model_dir), dtype="float32", **SCENARIOS[scenario])
    recorder = _Recorder(llm.engine.scheduler)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    outputs = llm.generate(PROMPTS, params)

    for i, (out, ref) in enumerate(zip(outputs, expected, strict=True)):
        assert out.outputs[0].token_ids == ref, f"prompt {i} diverged"
        assert out.outputs[0].finish_reason == "length"

    bm = llm.engine.block_manager
    bm.check_integrity()
    assert bm.num_used_blocks == 0
    assert not llm.engine.scheduler.has_unfinished

    budget = llm.engine.config.max_num_batched_tokens
    assert all(sum(n for *_, n in step) <= budget for step in recorder.steps)
    running_at_once = max(len(step) for step in recorder.steps)
    if scenario == "one_at_a_time":
        assert running_at_once == 1
        # The repeated prompt and the shared prefix were served from the prefix cache.
        assert llm.engine.scheduler.num_prefix_cache_hits >= 16 + 16
    else:
        assert running_at_once > 1
    if scenario == "chunked_prefill":
        # Some prompt was computed in several chunks.
        partial = [
            (rid, start, n)
            for step in recorder.steps
            for rid, start, n in step
            if start + n < len(PROMPTS[int(rid.split("#")[0])])
        ]
        assert partial
    if scenario == "preemption":
        assert llm.engine.scheduler.num_preemptions_total > 0
    if scenario == "no_prefix_caching":
        assert llm.engine.scheduler.num_prefix_cache_hits == 0


def test_one_request_alone_equals_batched(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    batched = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    alone = [llm.generate([p], params)[0].outputs[0].token_ids for p in PROMPTS[:3]]
    assert alone == batched[:3]


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [("qwen3", dict(head_dim=32)), ("mistral", dict(sliding_window=None))],
)
def test_other_families_match_transformers(tmp_path, arch, overrides):
    from tests.conftest import build_tiny_model

    model_dir = build_tiny_model(tmp_path / arch, arch, seed=3, **overrides)
    expected = _reference(model_dir)
    llm = LLM(str(model_dir), dtype="float32", max_num_batched_tokens=16)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    outputs = llm.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in outputs] == expected
