"""Overlap scheduling is exact: with `overlap_scheduling` the engine launches step t+1 before it
reads step t back (a decoding request's input token carried on the device), and every answer is
still the one the engine gives without it, token for token: greedy with every proposer and
mode, seeded and engine-seeded sampling with logprobs, stop tokens and strings that end a
request while its next step is already running, n > 1, preemption under a small KV pool, and
aborts while a step is in flight. No KV block is leaked. (The sampled law of overlapped steps is
tested by chi-square in test_spec_distribution.py; the overlap itself, a step's wall time close
to max(forward, host), in tests/unit/test_overlap_timing.py.)"""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.outputs import OutputAccumulator
from tests.integration.test_greedy_parity import MAX_TOKENS, PROMPTS


def _llm(target, overlap: bool, spec: dict | None = None, **config) -> LLM:
    return LLM(
        str(target),
        dtype="float32",
        seed=3,
        overlap_scheduling=overlap,
        speculative_config=spec,
        **config,
    )


def _spec(method: str, mode: str, draft) -> dict:
    spec = {
        "method": method,
        "mode": mode,
        "num_speculative_tokens": 3,
        "prompt_lookup_min": 1,
        "draft_min_confidence": 0.0,
    }
    if "draft_model" in method:
        spec["model"] = str(draft)
    return spec


def _generate(llm: LLM, params) -> list[list[int]]:
    outputs = llm.generate(PROMPTS, params)
    engine = llm.engine
    engine.block_manager.check_integrity()
    assert engine.block_manager.num_used_blocks == 0
    assert not engine.has_unfinished_requests()
    assert all(r.num_in_flight == 0 for r in engine.scheduler.waiting)
    return [o.outputs[0].token_ids for o in outputs]


def _greedy():
    return [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]


def test_overlapped_greedy_equals_transformers(target, expected):
    llm = _llm(target, True)
    assert _generate(llm, _greedy()) == expected
    metrics = llm.engine.metrics
    # Every step but the prompts' first and the last ones overlapped.
    assert metrics.num_overlapped_steps > metrics.num_steps // 2, vars(metrics)


@pytest.mark.parametrize(
    ("method", "mode"),
    [
        ("ngram", "off"),
        ("ngram", "auto"),
        ("ngram", "always"),
        ("draft_model", "auto"),
        ("ngram+draft_model", "auto"),
        ("ngram+draft_model", "always"),
    ],
)
def test_overlapped_speculation_is_lossless(target, random_draft, expected, method, mode):
    """Steps that draft read the one in flight first; the others overlap. Either way greedy
    output equals plain decoding."""
    llm = _llm(target, True, _spec(method, mode, random_draft))
    assert _generate(llm, _greedy()) == expected
    engine = llm.engine
    if mode == "off":
        assert engine.metrics.num_overlapped_steps > engine.metrics.num_steps // 2
        assert engine.spec_stats.num_draft_tokens == 0
    if mode == "always":
        assert engine.spec_stats.num_draft_tokens > 0


def test_overlapped_auto_overlaps_once_lookups_pause(target):
    """In auto, requests whose lookups do not pay pause them, and the steps between their
    lookups overlap: the pipeline drains only when a lookup is due."""
    llm = _llm(target, True, _spec("ngram", "auto", None))
    # The tiny random model's lookups are almost never right: they stop paying at once.
    params = [SamplingParams(temperature=0, max_tokens=60, ignore_eos=True) for _ in PROMPTS]
    llm.generate(PROMPTS, params)
    metrics = llm.engine.metrics
    assert metrics.num_overlapped_steps > metrics.num_steps // 2, vars(metrics)
    decisions = llm.engine.policy_stats.decisions
    # The requests of an overlapped step are counted, by why they could not draft.
    assert decisions.get(("skip", "in_flight"), 0) > 0, decisions
    assert decisions.get(("skip", "paused"), 0) + decisions.get(("skip", "low_acceptance"), 0)


@pytest.mark.parametrize("logprobs", [None, 0, 3])
def test_overlapped_sampling_equals_plain(target, logprobs):
    """Seeded and engine-seeded sampling draw the same tokens (keyed by position), and the
    logprobs read back in the packed copy are the plain path's."""
    params = [
        SamplingParams(
            temperature=0.9,
            top_k=20,
            top_p=0.95,
            max_tokens=n,
            ignore_eos=True,
            seed=i if i % 2 else None,
            logprobs=logprobs,
            min_tokens=3,
        )
        for i, n in enumerate(MAX_TOKENS)
    ]
    plain = _llm(target, False).generate(PROMPTS, params)
    overlapped_llm = _llm(target, True)
    overlapped = overlapped_llm.generate(PROMPTS, params)
    assert overlapped_llm.engine.metrics.num_overlapped_steps > 0
    for a, b in zip(plain, overlapped, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


def test_stops_while_the_next_step_runs(target, expected):
    """A stop token or a max_tokens reached in step t ends the request there; what step t+1
    (already launched) computed for it is dropped."""
    stops = [out[len(out) // 2] for out in expected]
    params = [
        SamplingParams(temperature=0, max_tokens=n, stop_token_ids=[stop])
        for n, stop in zip(MAX_TOKENS, stops, strict=True)
    ]
    plain = [o.outputs[0] for o in _llm(target, False).generate(PROMPTS, params)]
    got = [o.outputs[0] for o in _llm(target, True).generate(PROMPTS, params)]
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in plain]
    for out, reference, stop in zip(got, expected, stops, strict=True):
        assert out.token_ids == reference[: reference.index(stop) + 1]


def test_n_sequences_and_one_token_requests(target, expected):
    params = [SamplingParams(temperature=0.7, n=3, seed=11, max_tokens=7, ignore_eos=True)]
    params += [SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)] * (len(PROMPTS) - 1)
    plain = _llm(target, False).generate(PROMPTS, params)
    got = _llm(target, True).generate(PROMPTS, params)
    assert [[c.token_ids for c in o.outputs] for o in got] == [
        [c.token_ids for c in o.outputs] for o in plain
    ]
    assert [o.outputs[0].token_ids for o in got[1:]] == [e[:1] for e in expected[1:]]


@pytest.mark.parametrize(
    "scenario",
    [
        dict(block_size=4, num_kv_blocks=24, max_model_len=80),  # preemption mid-generation
        dict(block_size=4, num_kv_blocks=200, max_num_batched_tokens=16),  # chunked prefill
        dict(block_size=1, num_kv_blocks=600, enable_prefix_caching=False),
    ],
)
def test_overlapped_steps_under_pressure(target, expected, scenario):
    llm = _llm(target, True, **scenario)
    assert _generate(llm, _greedy()) == expected
    if scenario["num_kv_blocks"] == 24:
        assert llm.engine.scheduler.num_preemptions_total > 0
    assert llm.engine.metrics.num_overlapped_steps > 0


def test_aborts_while_a_step_is_in_flight(target, expected):
    """Requests aborted between an overlapped step's launch and its read-back lose their
    results and their blocks; every other request's output is unchanged."""
    engine = _llm(target, True).engine
    params = _greedy()
    for i, (prompt, p) in enumerate(zip(PROMPTS, params, strict=True)):
        engine.add_request(str(i), prompt, p)
    aborted = {"1", "4", "6"}
    done, outputs = {}, OutputAccumulator()
    num_steps = 0
    while engine.has_unfinished_requests():
        for o in outputs.add_step(engine.step()):
            done[o.request_id] = o.outputs[0].token_ids
        num_steps += 1
        if num_steps == 4:
            assert engine._inflight is not None  # the aborts land while a step runs
            for request_id in sorted(aborted):
                assert engine.abort(request_id)
    for i, reference in enumerate(expected):
        if str(i) not in aborted:
            assert done[str(i)] == reference
    assert not aborted & set(done)
    engine.block_manager.check_integrity()
    assert engine.block_manager.num_used_blocks == 0
    assert engine.metrics.num_finished["abort"] == len(aborted)


def test_penalty_rows_run_in_series_beside_overlapped_ones(target):
    """A row whose sampling reads its history (penalties) keeps its step from staying in flight;
    the steps after those requests finish overlap again, and every answer is the plain one."""
    params = [
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, presence_penalty=1.5)
        if i % 3 == 0
        else SamplingParams(temperature=0.8, seed=i, max_tokens=n, ignore_eos=True)
        for i, n in enumerate(MAX_TOKENS)
    ]
    plain = _llm(target, False).generate(PROMPTS, params)
    llm = _llm(target, True)
    got = llm.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    metrics = llm.engine.metrics
    # The prompts' step and the five decode steps of the penalty rows ran in series.
    assert metrics.num_overlapped_steps == metrics.num_steps - 6, vars(metrics)
