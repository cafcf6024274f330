"""Speculative decoding is lossless: greedy float32 output with every proposer and K equals the
non-speculative engine and transformers `generate`, in mixed batches with chunked prefill and
preemption; sampled output with one-hot drafts equals non-speculative sampled output."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.outputs import OutputAccumulator
from tests.conftest import build_tiny_model
from tests.integration.test_greedy_parity import MAX_TOKENS, PROMPTS


def _spec(method: str, k: int, draft, mode: str = "always") -> dict:
    # Full windows: the tiny random draft is never confident enough for the default early exit.
    # "always" keeps k fixed (the auto policy's k depends on measured step times).
    config = {
        "method": method,
        "mode": mode,
        "num_speculative_tokens": k,
        "prompt_lookup_min": 1,
        "draft_min_confidence": 0.0,
    }
    if "draft_model" in method:
        config["model"] = str(draft)
    return config


def _greedy_params():
    return [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]


def _run(llm: LLM):
    outputs = llm.generate(PROMPTS, _greedy_params())
    bm = llm.engine.block_manager
    bm.check_integrity()
    assert bm.num_used_blocks == 0
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("k", [1, 3, 5, 8])
@pytest.mark.parametrize("method", ["ngram", "draft_model", "self_draft", "ngram+draft_model"])
def test_greedy_speculation_is_lossless(target, random_draft, expected, method, k):
    draft = target if method == "self_draft" else random_draft
    name = "draft_model" if method == "self_draft" else method
    llm = LLM(str(target), dtype="float32", speculative_config=_spec(name, k, draft))
    assert _run(llm) == expected
    stats = llm.engine.spec_stats
    assert stats.num_draft_tokens > 0
    assert sum(stats.accepted_per_pos) == stats.num_accepted_tokens
    if method == "self_draft":
        # A draft identical to the target is always right.
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    if method == "draft_model":
        assert stats.num_accepted_tokens < stats.num_draft_tokens  # rejections happened


@pytest.mark.parametrize("method", ["ngram", "draft_model", "ngram+draft_model"])
def test_greedy_auto_policy_is_lossless(target, random_draft, expected, method):
    """Under the auto policy k varies per request and step (and the draft model pauses and
    catches up); the output must still equal plain greedy decoding."""
    llm = LLM(
        str(target), dtype="float32", speculative_config=_spec(method, 5, random_draft, "auto")
    )
    assert _run(llm) == expected
    decisions = llm.engine.policy_stats.decisions
    assert sum(decisions.values()) > 0
    assert set(decisions) <= {("speculate", "goodput")} | {
        # catch_up: a step of the draft model's catch-up in chunks (its timings decide when);
        # paused: a lookup that did not pay, tried again a few steps later.
        ("skip", r)
        for r in ("compute_bound", "low_acceptance", "catch_up", "catch_up_cost", "paused")
    }


@pytest.mark.parametrize(
    "scenario",
    [
        dict(max_num_batched_tokens=7),  # chunked prefill while others verify
        dict(block_size=4, num_kv_blocks=24, max_model_len=80),  # preemption mid-generation
        dict(block_size=1, num_kv_blocks=600),
    ],
)
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_under_pressure(target, random_draft, expected, method, scenario):
    llm = LLM(
        str(target), dtype="float32", speculative_config=_spec(method, 3, random_draft), **scenario
    )
    assert _run(llm) == expected
    if "num_kv_blocks" in scenario and scenario["num_kv_blocks"] == 24:
        assert llm.engine.scheduler.num_preemptions_total > 0


def test_sampling_with_one_hot_drafts_equals_plain_sampling(target):
    """With one-hot drafts each position draws its token exactly as plain sampling would, so a
    seeded (or engine-seeded) request samples the very same tokens with speculation, whether
    its drafts come from n-gram lookup or from a prediction."""
    params = [
        SamplingParams(temperature=0.9, top_k=20, max_tokens=n, ignore_eos=True, seed=i)
        for i, n in enumerate(MAX_TOKENS)
    ]
    plain = [
        o.outputs[0].token_ids
        for o in LLM(str(target), dtype="float32", seed=3).generate(PROMPTS, params)
    ]
    spec = LLM(str(target), dtype="float32", seed=3, speculative_config=_spec("ngram", 4, None))
    assert [o.outputs[0].token_ids for o in spec.generate(PROMPTS, params)] == plain
    # Sampled n-gram drafts of this tiny model are accepted about once in twenty: how many of
    # these few are depends on the seeds' draws. The predictions below are accepted for sure.
    assert spec.engine.spec_stats.num_draft_tokens > 0
    engine = LLM(str(target), dtype="float32", seed=3).engine
    for i, (prompt, p) in enumerate(zip(PROMPTS, params, strict=True)):
        engine.add_request(str(i), prompt, p, prediction=plain[i])
    done, whole = {}, OutputAccumulator()
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0].token_ids for o in whole.add_step(engine.step())})
    assert [done[str(i)] for i in range(len(PROMPTS))] == plain
    assert engine.spec_stats.num_prediction_rejected == 0
    assert engine.spec_stats.num_prediction_accepted > 0


def test_predicted_outputs(target, expected):
    """A prediction equal to the true output is accepted in full; one with an edit in the middle
    is rejected there and picked up again after it; neither changes the output."""
    llm = LLM(str(target), dtype="float32")
    truth = expected[0]
    params = SamplingParams(temperature=0, max_tokens=len(truth), ignore_eos=True)
    edited = truth[:10] + [(truth[10] + 7) % 300 + 3] + truth[11:]
    engine = llm.engine
    engine.add_request("right", PROMPTS[0], params, prediction=truth)
    engine.add_request("edited", PROMPTS[0], params, prediction=edited)
    done, whole = {}, OutputAccumulator()
    while engine.has_unfinished_requests():
        for out in whole.add_step(engine.step()):
            done[out.request_id] = out.outputs[0]
    assert done["right"].token_ids == truth and done["edited"].token_ids == truth
    right = done["right"].spec_stats
    # Every token after the first (sampled at prefill) came from the prediction or as a bonus.
    assert right.num_prediction_rejected == 0
    assert right.num_prediction_accepted + right.num_drafts + 1 == len(truth)
    edit = done["edited"].spec_stats
    assert edit.num_prediction_rejected > 0
    assert edit.num_prediction_accepted > 10  # re-synchronised after the edit
    total = engine.spec_stats
    assert (
        total.num_prediction_accepted
        == right.num_prediction_accepted + edit.num_prediction_accepted
    )


def test_logprobs_with_speculation_equal_plain(target, random_draft):
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=4, ignore_eos=True)
    plain = LLM(str(target), dtype="float32").generate(PROMPTS[:4], params)
    spec = LLM(
        str(target), dtype="float32", speculative_config=_spec("draft_model", 3, random_draft)
    )
    outs = spec.generate(PROMPTS[:4], params)
    for a, b in zip(plain, outs, strict=True):
        la, lb = a.outputs[0].logprobs, b.outputs[0].logprobs
        assert [e.token_id for e in la] == [e.token_id for e in lb]
        for ea, eb in zip(la, lb, strict=True):
            assert ea.logprob == pytest.approx(eb.logprob, abs=1e-4)
            assert ea.top_token_ids == eb.top_token_ids
            assert list(ea.top_logprobs) == pytest.approx(list(eb.top_logprobs), abs=1e-4)


@pytest.mark.parametrize("k", [3, 8])
def test_stop_conditions_inside_an_accepted_window(target, expected, k):
    """A self-draft accepts whole windows; stop tokens and max_tokens falling inside one must
    end the output exactly where plain decoding ends it."""
    spec = _spec("draft_model", k, target)
    llm = LLM(str(target), dtype="float32", speculative_config=spec)
    truth = expected[3]  # 24 tokens
    # Token 0 comes from the prefill; each window of k + 1 tokens ends with the bonus. Stop on
    # a token inside a window, so accepted drafts after it must be cut.
    first = next(p for p in range(1, 24) if truth.index(truth[p]) == p and p % (k + 1))
    stop_at = truth[first]
    out = llm.generate(
        [PROMPTS[3]],
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[stop_at]),
    )[0].outputs[0]
    assert out.token_ids == truth[: first + 1] and out.finish_reason == "stop"
    for n in (2, 7, 11):
        out = llm.generate(
            [PROMPTS[3]], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        )[0].outputs[0]
        assert out.token_ids == truth[:n] and out.finish_reason == "length"
    assert llm.engine.spec_stats.num_cut_by_stop > 0
    llm.engine.block_manager.check_integrity()


def test_seeded_draft_model_sampling_ignores_the_batch(target, random_draft):
    llm = LLM(
        str(target), dtype="float32", speculative_config=_spec("draft_model", 3, random_draft)
    )
    params = SamplingParams(temperature=1.0, max_tokens=16, seed=77, ignore_eos=True)
    alone = llm.generate([PROMPTS[2]], params)[0].outputs[0].token_ids
    noise = SamplingParams(temperature=1.2, max_tokens=10, ignore_eos=True)
    mixed = llm.generate([PROMPTS[0], PROMPTS[2], PROMPTS[5]], [noise, params, noise])
    assert mixed[1].outputs[0].token_ids == alone
    assert llm.engine.spec_stats.num_draft_tokens > llm.engine.spec_stats.num_accepted_tokens > 0


def test_prefix_hit_never_inherits_unwritten_draft_kv(target):
    """A self-draft accepts every draft. Request A is aborted right after fully accepted windows
    (its last accepted draft's draft-KV not written yet); request B then hits A's blocks in the
    prefix cache. B must still accept every draft: no block was cached ahead of the draft KV."""
    llm = LLM(
        str(target),
        dtype="float32",
        block_size=1,
        num_kv_blocks=400,
        speculative_config=_spec("draft_model", 3, target),
    )
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    engine.add_request("a", PROMPTS[2], params)
    for _ in range(3):  # prefill + two verify steps
        engine.step()
    a_tokens = engine._groups["a"].requests[0].output_token_ids[:]
    assert engine.spec_stats.num_accepted_tokens == engine.spec_stats.num_draft_tokens == 6
    engine.abort("a")
    before = engine.spec_stats.num_draft_tokens, engine.spec_stats.num_accepted_tokens
    engine.add_request(
        "b", PROMPTS[2] + a_tokens, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    )
    while engine.has_unfinished_requests():
        engine.step()
    drafted = engine.spec_stats.num_draft_tokens - before[0]
    accepted = engine.spec_stats.num_accepted_tokens - before[1]
    assert engine.scheduler.num_prefix_cache_hits > 0
    assert drafted > 0 and accepted == drafted


@pytest.fixture(scope="module")
def shared_tokenizer(tmp_path_factory):
    """A tokenizer of fewer ids than either model's vocabulary (checkpoints pad their tables)."""
    from tests.tiny_tokenizers import byte_level_bpe

    corpus = ["def reverse(s):\n    return s[::-1]\n", "the quick brown fox jumps over it"] * 20
    tokenizer = byte_level_bpe(corpus, 280, ["<|endoftext|>"])
    path = tmp_path_factory.mktemp("shared-tokenizer")
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.parametrize("draft_vocab", [300, 336])
def test_a_draft_with_a_differently_padded_vocabulary(
    target, shared_tokenizer, tmp_path, draft_vocab
):
    """Qwen2.5-Coder 7B pads its vocabulary to 152,064 and the 1.5B draft to 151,936: a draft
    narrower or wider than the target, sharing its tokenizer, drafts only ids the target has,
    greedy output stays exactly the plain output, and sampling with the draft's q works."""
    draft = build_tiny_model(
        tmp_path / "draft", "llama", seed=5, num_hidden_layers=1, vocab_size=draft_vocab
    )
    kwargs = dict(dtype="float32", tokenizer=str(shared_tokenizer))
    plain = LLM(str(target), **kwargs)
    llm = LLM(str(target), **kwargs, speculative_config=_spec("draft_model", 4, draft))
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, _greedy_params())] == [
        o.outputs[0].token_ids for o in plain.generate(PROMPTS, _greedy_params())
    ]
    assert llm.engine.spec_stats.num_draft_tokens > 0
    sampled = SamplingParams(temperature=1.0, max_tokens=12, seed=5, ignore_eos=True)
    alone = llm.generate([PROMPTS[2]], sampled)[0].outputs[0].token_ids
    mixed = llm.generate([PROMPTS[0], PROMPTS[2]], [_greedy_params()[0], sampled])
    assert mixed[1].outputs[0].token_ids == alone
    assert all(0 <= t < 320 for t in alone)
    llm.engine.block_manager.check_integrity()


def test_a_draft_that_does_not_cover_the_tokenizer_is_refused(target, tmp_path):
    draft = build_tiny_model(tmp_path / "draft", "llama", num_hidden_layers=1, vocab_size=200)
    with pytest.raises(ValueError, match="share a tokenizer"):
        LLM(str(target), speculative_config=_spec("draft_model", 2, draft))


@pytest.mark.parametrize(
    "scenario",
    [
        {},
        dict(max_num_batched_tokens=7),  # prompts in chunks, beside other requests' verifies
        dict(block_size=4, num_kv_blocks=24, max_model_len=80),  # preempted: the draft starts over
    ],
)
def test_a_draft_model_that_follows_prefill_is_lossless(target, random_draft, expected, scenario):
    spec = {**_spec("draft_model", 3, random_draft), "draft_follows_prefill": True}
    llm = LLM(str(target), dtype="float32", speculative_config=spec, **scenario)
    assert _run(llm) == expected
    assert llm.engine.spec_stats.num_draft_tokens > 0


@pytest.mark.parametrize("follows", [True, False])
def test_a_draft_model_that_follows_prefill_is_current_when_decoding_starts(target, follows):
    """A self-draft (always right, so a draft KV that is wrong anywhere would show as a
    rejection) reads the prompt in the target's prefill steps: the first decode step catches up
    on nothing, and every draft is accepted. Lazy, it catches up on the whole prompt then."""
    spec = {**_spec("draft_model", 3, target), "draft_follows_prefill": follows}
    llm = LLM(str(target), dtype="float32", max_num_batched_tokens=8, speculative_config=spec)
    engine = llm.engine
    drafter = engine.speculator.chain[0]
    prompt = PROMPTS[2]
    assert len(prompt) > 8  # prefilled over several steps
    engine.add_request("a", prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    request = engine._groups["a"].requests[0]
    while not request.output_token_ids:
        engine.step()
    assert drafter.num_behind(request) == (0 if follows else len(prompt))
    forward, chunk_lens = drafter.runner.forward, []

    def recorded(chunks, *args, **kwargs):
        chunk_lens.extend(len(c.token_ids) for c in chunks)
        return forward(chunks, *args, **kwargs)

    drafter.runner.forward = recorded
    engine.step()  # the first drafting step: its first forward reads what the draft lacks
    drafter.runner.forward = forward
    assert chunk_lens[0] == (1 if follows else len(prompt) + 1)
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.spec_stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens
