"""LLMEngine behaviour on a tiny model: aborts at every stage, stop conditions, n, seeds,
logprobs, input validation, and no leaked KV block after a randomized workload."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.engine import LLMEngine
from tests.conftest import TINY_VOCAB, build_tiny_model, ngram_llm


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(str(tiny_llama), dtype="float32", block_size=4, num_kv_blocks=128, max_model_len=256)


def _assert_idle(engine: LLMEngine) -> None:
    bm = engine.block_manager
    bm.check_integrity()
    assert bm.num_used_blocks == 0
    assert bm.num_free_blocks == bm.num_blocks
    assert not engine.scheduler.has_unfinished
    assert not engine.has_unfinished_requests()


def _step_until(engine: LLMEngine, predicate, limit: int = 200) -> None:
    for _ in range(limit):
        if predicate():
            return
        engine.step()
    raise AssertionError("condition not reached")


def test_abort_at_every_stage_frees_all_blocks(tiny_llama):
    llm = LLM(
        str(tiny_llama),
        dtype="float32",
        block_size=4,
        num_kv_blocks=64,
        max_num_batched_tokens=8,
        max_num_seqs=2,
        max_model_len=128,
    )
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    prompt = list(range(10, 40))  # 30 tokens: 4 chunks of 8
    engine.add_request("waiting", prompt, params)
    engine.add_request("prefill", prompt[::-1], params)
    engine.add_request("queued", [5, 6, 7], params)  # max_num_seqs=2 keeps it waiting
    engine.step()
    waiting = engine._groups["waiting"].requests[0]
    assert 0 < waiting.num_computed_tokens < len(prompt)  # mid-prefill
    assert engine.abort("queued")  # never scheduled
    assert engine.abort("waiting")  # in the middle of its prompt
    _step_until(engine, lambda: engine._groups["prefill"].requests[0].num_output_tokens >= 3)
    assert engine.abort("prefill")  # in the middle of decoding
    assert not engine.abort("prefill")  # unknown now
    _assert_idle(engine)


def test_stop_token_ids_and_length(llm):
    greedy = llm.generate(
        [[7, 8, 9]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    )
    tokens = greedy[0].outputs[0].token_ids
    stop_at = tokens[5]
    first = tokens.index(stop_at)
    out = llm.generate(
        [[7, 8, 9]],
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_at]),
    )[0].outputs[0]
    assert out.token_ids == tokens[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at
    assert greedy[0].outputs[0].finish_reason == "length" and len(tokens) == 12


def test_min_tokens_defers_stop_token(llm):
    tokens = llm.generate(
        [[7, 8, 9]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    )
    stop_at = tokens[0].outputs[0].token_ids[0]
    out = llm.generate(
        [[7, 8, 9]],
        SamplingParams(temperature=0, max_tokens=12, min_tokens=4, stop_token_ids=[stop_at]),
    )[0].outputs[0]
    assert len(out.token_ids) >= 4
    assert stop_at not in out.token_ids[:4]


def test_eos_stops_unless_ignored(tiny_llama):
    # Make EOS (id 2) overwhelmingly likely via logit_bias; the engine must stop right there.
    llm = LLM(str(tiny_llama), dtype="float32")
    biased = SamplingParams(temperature=0, max_tokens=8, logit_bias={2: 100.0})
    out = llm.generate([[4, 5]], biased)[0].outputs[0]
    assert out.token_ids == [2] and out.finish_reason == "stop"
    ignored = SamplingParams(temperature=0, max_tokens=8, logit_bias={2: 100.0}, ignore_eos=True)
    out = llm.generate([[4, 5]], ignored)[0].outputs[0]
    assert out.token_ids == [2] * 8 and out.finish_reason == "length"


def test_n_and_seeds(llm):
    params = SamplingParams(temperature=1.0, max_tokens=10, seed=1234, n=3, ignore_eos=True)
    first = llm.generate([[3, 4, 5]], params)[0]
    again = llm.generate([[3, 4, 5]], params)[0]
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in again.outputs]
    assert len({tuple(o.token_ids) for o in first.outputs}) > 1  # the n samples differ
    # The same seeded request inside a busy batch of unseeded ones samples the same tokens.
    noisy = [[9, 9, 9], [3, 4, 5], [1, 2, 3, 4]]
    mixed = llm.generate(
        noisy,
        [
            SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True),
            params,
            SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True),
        ],
    )
    assert [o.token_ids for o in mixed[1].outputs] == [o.token_ids for o in first.outputs]


def test_logprobs_match_transformers(tiny_llama, llm):
    prompt = [11, 12, 13, 14]
    out = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=5, logprobs=3, ignore_eos=True)
    )[0].outputs[0]
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + out.token_ids])
    with torch.no_grad():
        ref = torch.log_softmax(model(ids).logits[0].float(), dim=-1)  # [seq, vocab]
    assert len(out.logprobs) == 5
    for i, entry in enumerate(out.logprobs):
        row = ref[len(prompt) - 1 + i]
        assert entry.token_id == out.token_ids[i]
        assert entry.logprob == pytest.approx(row[entry.token_id].item(), abs=1e-4)
        top = torch.topk(row, 3)
        assert list(entry.top_token_ids) == top.indices.tolist()
        assert list(entry.top_logprobs) == pytest.approx(top.values.tolist(), abs=1e-4)


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([], SamplingParams(), "empty"),
        ([TINY_VOCAB], SamplingParams(), "outside the vocabulary"),
        ([-1], SamplingParams(), "outside the vocabulary"),
        (list(range(3, 259)), SamplingParams(), "context"),
        ([5, 6], SamplingParams(max_tokens=255), "exceeds"),
        ([5, 6], SamplingParams(stop_token_ids=[TINY_VOCAB + 5]), "outside the vocabulary"),
        ([5, 6], SamplingParams(logit_bias={TINY_VOCAB: 1.0}), "outside the vocabulary"),
    ],
)
def test_bad_input_is_a_clear_error(llm, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        llm.engine.add_request("bad", prompt, params)
    assert not llm.engine.has_unfinished_requests()


def test_text_prompt_without_tokenizer_is_rejected(llm):
    with pytest.raises(ValueError, match="token ids"):
        llm.engine.add_request("text", "hello", SamplingParams())


@pytest.mark.parametrize("spec", [None, "ngram", "draft_model"])
def test_randomized_workload_never_leaks(tiny_qwen2, tmp_path, spec):
    """200 requests with random lengths, sampling options and aborts over a pool small enough to
    force preemption: everything finishes or is aborted, and every block comes back. With
    speculation, a draft model of other weights forces rejections."""
    config = None
    if spec is not None:
        # "always": the test is about blocks, and auto's choices follow measured step times.
        config = {
            "method": spec,
            "num_speculative_tokens": 4,
            "prompt_lookup_min": 1,
            "mode": "always",
        }
        if spec == "draft_model":
            config["model"] = str(build_tiny_model(tmp_path / "draft", "qwen2", seed=9))
    llm = LLM(
        str(tiny_qwen2),
        dtype="float32",
        block_size=4,
        num_kv_blocks=48,
        max_num_batched_tokens=32,
        max_num_seqs=8,
        max_model_len=96,
        speculative_config=config,
    )
    engine = llm.engine
    rng = random.Random(0)
    live: list[str] = []
    finished = 0
    for i in range(200):
        prompt = [rng.randrange(3, TINY_VOCAB) for _ in range(rng.randint(1, 40))]
        params = SamplingParams(
            temperature=rng.choice([0.0, 0.8]),
            top_k=rng.choice([0, 5]),
            max_tokens=rng.randint(1, 30),
            seed=rng.choice([None, i]),
            n=rng.choice([1, 1, 2]),
        )
        engine.add_request(str(i), prompt, params)
        live.append(str(i))
        if rng.random() < 0.2:
            engine.abort(live.pop(rng.randrange(len(live))))
        for output in engine.step():
            if output.finished:
                finished += 1
                live.remove(output.request_id)
        engine.block_manager.check_integrity()
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished += 1
    assert finished > 100
    assert engine.scheduler.num_preemptions_total > 0
    if spec is not None:
        stats = engine.spec_stats
        assert stats.num_draft_tokens > stats.num_accepted_tokens
    _assert_idle(engine)


def test_mode_off_decides_every_decoding_step_without_a_lookup(tiny_llama, monkeypatch):
    """With speculation off, each decoding step of each request is one mode_off decision, and
    no n-gram lookup runs for it (the decision needs no draft)."""
    llm = ngram_llm(tiny_llama, mode="off")
    lookup = llm.engine.speculator.chain[0]
    monkeypatch.setattr(lookup, "propose", lambda *a: pytest.fail("a lookup ran in mode off"))
    prompt = [5, 6, 7, 5, 6, 7, 5, 6, 7]  # every suffix recurs: a lookup would always draft
    outputs = llm.generate([prompt, prompt[1:]], SamplingParams(max_tokens=12, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outputs] == [12, 12]
    # Token 1 comes from the prompt's forward and token 12 from a step with no room for a draft
    # (max_tokens): the 10 steps between are decided.
    assert llm.engine.policy_stats.decisions == {("skip", "mode_off"): 2 * 10}
