"""The step trace (SPECSERVE_STEP_TRACE): one line per engine step, agreeing with the engine's own
counters; and bench/policy/step_trace.py's summary of it per mode."""

from __future__ import annotations

import json

import pytest

from bench.policy import step_trace
from engine.sampling_params import SamplingParams
from tests.conftest import ngram_llm

# Token ids (the tiny model has no tokenizer) that repeat, so n-gram lookups find drafts.
PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 9, 10, 11, 9, 10], [3, 4, 3, 4, 3, 4]]


def test_the_trace_has_a_line_per_step_that_adds_up_to_the_engines_counters(
    tiny_llama, tmp_path, monkeypatch
) -> None:
    path = tmp_path / "steps.jsonl"
    monkeypatch.setenv("SPECSERVE_STEP_TRACE", str(path))
    llm = ngram_llm(tiny_llama)
    engine = llm.engine
    steps = 0
    original = engine.step

    def counted():
        nonlocal steps
        outputs = original()
        steps += 1
        return outputs

    engine.step = counted
    # What the step-time model predicted for each step before it learned from it.
    model = engine.policy.step_model
    predictions = []
    learn = model.observe

    def observe(n, context, seconds, rows=1):
        predictions.append(model.predict(n, context, rows))
        learn(n, context, seconds, rows)

    model.observe = observe
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params)
    lines = [json.loads(line) for line in path.read_text().splitlines()]

    assert len(lines) == steps > 0
    assert [line["t"] for line in lines] == sorted(line["t"] for line in lines)
    assert {line["mode"] for line in lines} == {"always"}
    assert sum(line["generated"] for line in lines) == sum(
        len(o.outputs[0].token_ids) for o in outputs
    )
    stats = engine.spec_stats
    assert sum(line["draft_tokens"] for line in lines) == stats.num_draft_tokens > 0
    assert sum(line["accepted"] for line in lines) == stats.num_accepted_tokens
    decisions = sum(sum(line["reasons"].values()) for line in lines)
    assert decisions == sum(engine.policy_stats.decisions.values())
    for line in lines:
        assert line["tokens"] >= line["rows"] >= 0 and line["scheduled"] >= 1
        assert line["forward"] > 0 and line["overhead"] >= 0 and line["draft"] >= 0
        assert line["correction"] >= 1.0  # never a discount (engine/policy/costs.py)
    assert [line["predicted"] for line in lines] == pytest.approx(predictions, abs=1e-6)
    assert len(predictions) == steps and all(p > 0 for p in predictions)

    summary = step_trace.by_mode(lines)["always"]
    assert summary["steps"] == steps
    assert summary["generated"] == sum(line["generated"] for line in lines)
    assert 0 < summary["drafting_steps"] <= 1
    assert summary["accepted_per_draft_token"] == stats.num_accepted_tokens / (
        stats.num_draft_tokens
    )


def test_without_the_variable_nothing_is_traced(tiny_llama, monkeypatch) -> None:
    monkeypatch.delenv("SPECSERVE_STEP_TRACE", raising=False)
    llm = ngram_llm(tiny_llama)
    assert not llm.engine.step_trace.is_on
    llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=4))


def test_decode_only_groups_steps_of_one_token_per_request_by_batch_size() -> None:
    def step(mode, tokens, rows, scheduled, forward, drafting=0):
        return {
            "mode": mode,
            "tokens": tokens,
            "rows": rows,
            "scheduled": scheduled,
            "forward": forward,
            "drafting": drafting,
            "draft_tokens": tokens - scheduled if drafting else 0,
        }

    steps = [
        step("off", 4, 4, 4, 0.1),
        step("off", 4, 4, 4, 0.3),
        step("auto", 4, 4, 4, 0.2),
        step("auto", 6, 6, 4, 0.5, drafting=1),  # drafts: not decode-only
        step("off", 40, 2, 2, 0.9),  # a prompt chunk
        step("auto", 2, 2, 2, 0.05),
    ]
    assert step_trace.decode_only(steps) == {
        2: {"auto": (1, 50.0)},
        4: {"auto": (1, 200.0), "off": (2, 200.0)},
    }


def test_runs_split_at_each_mode_switch_and_gap_and_read_the_commonest_batch() -> None:
    def step(t, mode, scheduled, forward, generated, tokens=None):
        tokens = scheduled if tokens is None else tokens
        return {
            "t": t,
            "mode": mode,
            "tokens": tokens,
            "rows": scheduled,
            "forward": forward,
            "draft": 0.0,
            "overhead": 0.0,
            "generated": generated,
            "scheduled": scheduled,
            "drafting": 0,
            "draft_tokens": 0,
        }

    steps = [
        step(0.0, "off", 4, 0.1, 4),
        step(0.1, "off", 4, 0.3, 4),
        step(0.4, "off", 3, 0.2, 3),
        step(0.6, "auto", 4, 0.2, 8, tokens=8),  # not decode-only
        step(0.8, "auto", 4, 0.4, 4),
        step(9.0, "auto", 2, 0.5, 2),  # after a gap: a run of its own
    ]
    turns = step_trace.runs(steps, gap=3.0)
    assert [(r["mode"], r["steps"], r["batch"]) for r in turns] == [
        ("off", 3, 4),
        ("auto", 2, 4),
        ("auto", 1, 2),
    ]
    assert (
        turns[0]["tokens_per_s"] == pytest.approx(11 / 0.6)
        and turns[0]["decode_forward_ms"] == 200.0
    )
    assert turns[1]["decode_steps"] == 1 and turns[1]["decode_forward_ms"] == 400.0
    assert turns[2]["start"] == 9.0


def test_kinds_split_a_modes_time_into_decode_drafting_and_prompt_steps() -> None:
    def step(tokens, scheduled, drafting, draft_tokens, forward, generated):
        return {
            "tokens": tokens,
            "scheduled": scheduled,
            "drafting": drafting,
            "draft_tokens": draft_tokens,
            "forward": forward,
            "draft": 0.0,
            "overhead": 0.0,
            "generated": generated,
        }

    steps = [
        step(4, 4, 0, 0, 0.1, 4),  # decode
        step(7, 4, 1, 3, 0.2, 6),  # drafting
        step(30, 4, 0, 0, 0.3, 3),  # a prompt chunk beside decode rows
        step(33, 4, 1, 3, 0.4, 5),  # a prompt chunk and drafts
    ]
    split = step_trace.kinds(steps, 1.0)
    assert {k: v["steps"] for k, v in split.items()} == {"decode": 1, "drafting": 1, "prompt": 2}
    assert split["prompt"]["time_share"] == pytest.approx(0.7)
    assert split["drafting"]["tokens_per_s"] == pytest.approx(30.0)
    assert split["prompt"]["tokens_per_s"] == pytest.approx(8 / 0.7)


def test_pricing_reads_forward_over_predicted_and_drafting_by_correction() -> None:
    def step(mode, forward, predicted, correction, drafting, decided=1):
        return {
            "mode": mode,
            "tokens": 4 + drafting,
            "scheduled": 4,
            "drafting": drafting,
            "draft_tokens": drafting,
            "forward": forward,
            "predicted": predicted,
            "correction": correction,
            "decided": decided,
        }

    steps = [
        step("off", 0.2, 0.1, 1.0, 0),
        step("auto", 0.1, 0.1, 1.01, 0),
        step("auto", 0.5, 0.25, 1.02, 1),
        step("auto", 0.2, 0.2, 1.14, 0),
        step("auto", 0.2, 0.2, 1.14, 0, decided=0),  # decided nothing: not counted by correction
        {**step("auto", 0.2, 0.0, 1.0, 0), "predicted": 0.0},  # no prediction: skipped
    ]
    priced = step_trace.pricing(steps)
    assert priced["forward_over_predicted"] == {
        "auto": {"decode": (3, 1.0), "drafting": (1, 2.0)},
        "off": {"decode": (1, 2.0)},
    }
    assert priced["drafting_by_correction"] == {1.0: (2, 1), 1.15: (1, 0)}
    # A trace from before the field existed has nothing to price.
    old = [{k: v for k, v in s.items() if k != "predicted"} for s in steps]
    assert step_trace.pricing(old) == {"forward_over_predicted": {}, "drafting_by_correction": {}}
