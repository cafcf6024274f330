"""An EAGLE-3 head in the published format, served by the engine: greedy output equals speculation
off token for token under chunked prefill, prefix caching and preemption, alone and chained after
n-gram; aborts leak no block and no head state; the head's drafts are counted under its name."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.conftest import build_tiny_model
from tests.eagle3_heads import build_tiny_eagle3_head

PROMPTS = [
    [1, 17, 42, 99, 5, 230, 64, 7, 18, 250, 3, 17, 42, 99],
    [1, 8, 8, 8, 9, 10, 11, 8, 8, 8, 9],
    [1, 300, 12, 44, 300, 12, 44, 300, 12],
    [1, 5] + list(range(20, 60)),  # 42 tokens: several prompt chunks
    [1, 17, 42, 99, 5, 230, 64, 7, 18, 250, 3, 100, 101],  # shares a prefix with the first
]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target = build_tiny_model(
        tmp_path_factory.mktemp("eagle3-target"), "llama", seed=5, num_hidden_layers=4
    )
    head = build_tiny_eagle3_head(
        tmp_path_factory.mktemp("eagle3-head"),
        target,
        seed=6,
        draft_vocab_size=160,
        aux_layer_ids=[1, 2, 3],
    )
    return target, head


def _llm(target, spec=None, **overrides):
    args = dict(
        dtype="float32",
        block_size=4,
        num_kv_blocks=96,
        max_model_len=160,
        max_num_batched_tokens=16,  # prompts arrive in chunks, beside decode and verify rows
        enable_prefix_caching=True,
    )
    args.update(overrides)
    return LLM(str(target), speculative_config=spec, **args)


def _spec(head, method="eagle3", **extra):
    return {
        "method": method,
        "model": str(head),
        "mode": "always",
        "num_speculative_tokens": 3,
        "draft_min_confidence": 0.0,
        "prompt_lookup_min": 1,
        **extra,
    }


@pytest.fixture(scope="module")
def expected(models):
    """Each prompt's greedy output without speculation, asked alone."""
    target, _ = models
    llm = _llm(target)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    return [llm.generate([p], params)[0].outputs[0].token_ids for p in PROMPTS]


def _check_greedy(llm, expected):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params)
    for i, out in enumerate(outputs):
        assert list(out.outputs[0].token_ids) == list(expected[i]), f"prompt {i}"
    assert llm.engine.block_manager.num_used_blocks == 0  # every block back (or cached)
    return llm.engine


@pytest.mark.parametrize("method", ["eagle3", "ngram+eagle3"])
def test_greedy_output_equals_speculation_off(models, expected, method):
    target, head = models
    llm = _llm(target, _spec(head, method))
    engine = _check_greedy(llm, expected)
    stats = engine.spec_stats
    assert stats.num_draft_tokens > 50, stats
    proposer = next(p for p in engine.speculator.chain if p.name == "eagle3")
    assert not proposer._states, "a finished request's head state was kept"
    # The second pass finds the prompts in the prefix cache: the head starts at the cached
    # length and drafts on, output unchanged.
    _check_greedy(llm, expected)


def test_greedy_output_survives_preemption(models, expected):
    target, head = models
    # 28 blocks of 4 tokens cannot hold five requests growing to 55-82 tokens: it preempts.
    llm = _llm(target, _spec(head), num_kv_blocks=28, max_model_len=96, enable_prefix_caching=False)
    engine = _check_greedy(llm, expected)
    assert engine.scheduler.num_preemptions_total > 0
    assert engine.spec_stats.num_draft_tokens > 0


def test_aborts_leak_no_block_and_no_head_state(models):
    target, head = models
    llm = _llm(target, _spec(head), enable_prefix_caching=False)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, params)
    for _ in range(6):
        engine.step()
    for i in (0, 2, 4):
        assert engine.abort(f"r{i}")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.num_used_blocks == 0
    proposer = engine.speculator.chain[0]
    assert not proposer._states
    assert engine.spec_stats.num_draft_tokens > 0


def test_sampled_drafts_carry_their_distribution(models):
    """At temperature > 0 the head's drafts come with q (sampled, verified by min(1, p/q))."""
    target, head = models
    llm = _llm(target, _spec(head))
    engine = llm.engine
    drafts = []
    propose = engine.speculator.chain[0].propose

    def spy(requests, max_lengths):
        found = propose(requests, max_lengths)
        drafts.extend(d for d in found if d is not None)
        return found

    engine.speculator.chain[0].propose = spy
    llm.generate(PROMPTS[:2], SamplingParams(temperature=1.0, seed=3, max_tokens=20))
    assert drafts and all(d.probs is not None for d in drafts)
    for d in drafts:
        assert d.probs.shape == (len(d.token_ids), engine.model_config.vocab_size)
        # q is 0 off the draft vocabulary, and every draft is in it.
        mapped = set(engine.speculator.chain[0].head.draft_to_target.tolist())
        assert set(d.token_ids) <= mapped
        assert float(d.probs[:, [t for t in range(320) if t not in mapped]].sum()) == 0.0
