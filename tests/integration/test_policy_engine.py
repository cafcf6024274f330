"""The speculation policy at work, driven as the engine drives it and in the engine, against a
fake step-time model (flat to 8 query tokens, then proportional to n): k falls to 0 past the knee
and comes back when load drops; opt-outs, caps and each operator limit are honoured and counted
with their reason; a paused draft model catches up exactly; calibration fits what it times."""

from __future__ import annotations

import pytest

from engine.core.chunks import attention_reads
from engine.core.request import Request
from engine.core.schedule import Candidate
from engine.llm import LLM
from engine.policy.calibration import measure
from engine.policy.calibration_cache import is_plausible
from engine.policy.policy import SpeculationPolicy
from engine.sampling_params import SamplingParams
from tests.policy_fakes import KNEE, Driver, FixedMonitor, FlatThenLinear, requests, shape


def _requests(num: int, **params) -> list[Request]:
    return requests(num, **params)


def _planner(mode: str = "auto", **kw) -> Driver:
    return Driver(SpeculationPolicy(mode, 7, FlatThenLinear(), **kw))


def _plan(planner: Driver, reqs: list[Request], room: int = 7) -> list[int]:
    return planner.plan_requests(reqs, room)


def test_k_falls_to_zero_past_the_knee_and_comes_back() -> None:
    planner = _planner()
    requests = _requests(32)
    totals = {}
    for batch in [1, 2, 4, 8, 16, 32, 16, 4, 1]:
        ks = _plan(planner, requests[:batch])
        totals.setdefault(batch, []).append(sum(ks))
        if batch >= KNEE:
            assert ks == [0] * batch
        else:
            assert batch + sum(ks) == KNEE  # drafts fill the flat region, no further
    assert totals[1] == [7, 7] and totals[4] == [4, 4] and totals[16] == [0, 0]
    stats = planner.stats
    assert stats.decisions[("skip", "compute_bound")] == 8 + 16 + 32 + 16
    assert stats.decisions[("speculate", "goodput")] == 1 + 2 + 4 + 4 + 1
    assert stats.draft_tokens_per_step.count == sum(stats.decisions.values())
    assert stats.num_requests_decoding == 1 and stats.num_requests_speculating == 1


def test_opt_out_and_caps_are_honoured() -> None:
    planner = _planner()
    out = _requests(1, speculate=False)[0]
    capped = _requests(1, max_draft_tokens=2)[0]
    zero = _requests(1, max_draft_tokens=0)[0]
    free = _requests(1)[0]
    candidates = [
        Candidate(r, room, "ngram") for r, room in [(out, 7), (capped, 7), (zero, 7), (free, 3)]
    ]
    ks = planner.plan(candidates, shape(4))
    assert ks[0] == 0 and ks[2] == 0
    assert 0 < ks[1] <= 2 and 0 < ks[3] <= 3
    assert planner.stats.decisions[("skip", "request_opt_out")] == 2


@pytest.mark.parametrize("mode", ["auto", "always"])
def test_operator_limits_switch_speculation_off_with_their_reason(mode: str) -> None:
    requests = _requests(4)
    by_batch = _planner(mode, disable_batch_size=4)
    assert _plan(by_batch, requests) == [0] * 4
    assert _plan(by_batch, requests[:3]) != [0] * 3  # below the limit it speculates again
    assert by_batch.stats.decisions[("skip", "batch_size")] == 4
    busy = _planner(mode, monitor=FixedMonitor(0.95), disable_utilization=0.9)
    assert _plan(busy, requests[:1]) == [0]
    assert busy.stats.decisions == {("skip", "utilization"): 1}
    idle = _planner(mode, monitor=FixedMonitor(0.5), disable_utilization=0.9)
    assert _plan(idle, requests[:1]) != [0]


def test_modes_off_and_always() -> None:
    requests = _requests(16)
    off = _planner("off")
    assert _plan(off, requests) == [0] * 16
    assert off.stats.decisions == {("skip", "mode_off"): 16}
    always = _planner("always")
    # Fixed K whatever the load, within the budget: 16 decode tokens + 16 x 7 drafts fit in 256.
    assert _plan(always, requests) == [7] * 16
    assert always.stats.decisions == {("speculate", "fixed"): 16}
    tight = always.plan([Candidate(r, 7, "ngram") for r in requests], shape(16, budget=20))
    assert sum(tight) == 20 and always.stats.decisions[("skip", "budget")] > 0


def test_draft_model_depth_pays_for_itself() -> None:
    """A draft-model forward costs 0.2 step per depth; lookup drafts cost nothing. A draft model
    that is always wrong is left idle (low_acceptance) while n-gram drafts still go; one that
    is always right drafts deep."""
    planner = _planner(draft_forward_seconds=0.2)
    bad, good, lookup = _requests(3)
    for _ in range(30):
        planner.verify(bad, "draft_model", 5, 0)
        planner.verify(good, "draft_model", 5, 5)
        planner.verify(lookup, "ngram", 5, 2)
    ks = planner.plan([Candidate(bad, 7, "draft_model"), Candidate(lookup, 7, "ngram")], shape(2))
    assert ks[0] == 0 and ks[1] > 0
    assert planner.stats.decisions[("skip", "low_acceptance")] == 1
    ks = planner.plan([Candidate(good, 7, "draft_model")], shape(1))
    assert ks[0] >= 5


def test_a_draft_model_the_prior_rules_out_is_tried_and_kept_where_it_pays() -> None:
    """Drafting pays at alpha 0.9 but not at the prior's 0.6 (one draft forward costs 0.8 of a
    step): judged by its prior alone a new request would never draft, so never show its 0.9.
    Decided by the upper bound, it drafts at once; a request that then accepts nothing is
    dropped after a few verifies, one that accepts everything keeps drafting deep."""
    cost = 0.8
    prior = 0.6
    assert _planner(draft_forward_seconds=cost).policy.tracker.priors["draft_model"] == prior
    judged_by_prior = _planner(draft_forward_seconds=cost)
    judged_by_prior.policy.tracker.optimism = 0.0
    first, second = _requests(2)
    assert judged_by_prior.plan([Candidate(first, 7, "draft_model")], shape(1)) == [0]
    planner = _planner(draft_forward_seconds=cost)
    for request, accepted in ((first, lambda k: k), (second, lambda k: 0)):
        ks = [planner.plan([Candidate(request, 7, "draft_model")], shape(1))[0]]
        assert ks[0] > 0
        for _ in range(8):
            planner.verify(request, "draft_model", ks[-1], accepted(ks[-1]))
            ks.append(planner.plan([Candidate(request, 7, "draft_model")], shape(1))[0])
        if request is first:
            assert min(ks) > 0 and ks[-1] >= 5
        else:
            assert ks[-1] == 0


@pytest.fixture(scope="module")
def target(tiny_llama):
    return tiny_llama


def _engine_llm(target, method: str, draft=None, **spec) -> LLM:
    config = {"method": method, "num_speculative_tokens": 4, "prompt_lookup_min": 1, **spec}
    if draft is not None:
        config.update(model=str(draft), draft_min_confidence=0.0)
    return LLM(str(target), dtype="float32", max_num_seqs=32, speculative_config=config)


def test_engine_stops_speculating_under_load_and_resumes(target, monkeypatch) -> None:
    llm = _engine_llm(target, "ngram")
    engine = llm.engine
    engine.policy.step_model = FlatThenLinear()
    # The fake curve's seconds are not the CPU's, so the correction learned from their quotient
    # (speculating steps' against plain ones') would price drafts by the CPU's verify cost at
    # random: held at none, the curve alone decides, as this test means.
    monkeypatch.setattr(type(engine.policy.costs), "correction", property(lambda self: 1.0))
    repetitive = [5, 6, 7, 8] * 6
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    engine.add_request("long", repetitive, params)
    for i in range(15):
        engine.add_request(f"short{i}", repetitive, SamplingParams(temperature=0, max_tokens=6))
    seen = []
    while engine.has_unfinished_requests():
        engine.step()
        stats = engine.policy_stats
        seen.append((stats.num_requests_decoding, stats.num_requests_speculating))
    assert any(d >= KNEE and s == 0 for d, s in seen)  # loaded: nobody speculates
    assert any(d == 1 and s == 1 for d, s in seen)  # alone again: "long" speculates
    assert engine.policy_stats.decisions[("skip", "compute_bound")] > 0
    assert engine.spec_stats.num_drafts > 0
    assert engine.block_manager.num_used_blocks == 0


def test_paused_draft_model_catches_up_exactly(target) -> None:
    """A self-draft accepts every draft. Paused for many steps (opted out of speculation by the
    batch limit), the draft model must resume with exact KV: still every draft accepted."""
    llm = _engine_llm(target, "draft_model", draft=target, spec_disable_batch_size=2)
    engine = llm.engine
    # Against the fake step time (1 s), the self-draft's real forwards cost next to nothing.
    engine.policy.step_model = FlatThenLinear()
    engine.policy.costs.draft_forward_seconds = 0.0
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    engine.add_request("a", [3, 1, 4, 1, 5, 9, 2, 6], params)
    engine.add_request("b", [2, 7, 1, 8], SamplingParams(temperature=0, max_tokens=15))
    while engine.has_unfinished_requests():
        engine.step()
    stats, decisions = engine.spec_stats, engine.policy_stats.decisions
    assert decisions[("skip", "batch_size")] > 0  # paused while b ran
    assert decisions.get(("speculate", "goodput"), 0) > 0  # resumed after
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens


def test_calibration_fits_what_it_times(target) -> None:
    llm = _engine_llm(target, "ngram", mode="always")
    engine = llm.engine

    def fake_timer(n: int, context: int) -> float:
        # Attention costs 1 us per KV position each query token reads.
        return 0.2 * max(1.0, n / 8) + 1e-6 * attention_reads(context, n)

    model = measure(
        engine.runner, engine.block_manager, 64, engine.max_model_len, timer=fake_timer
    ).model
    assert model.knee == 8 and is_plausible(model)
    flat = measure(
        engine.runner, engine.block_manager, 64, engine.max_model_len, timer=lambda n, c: 0.98
    ).model
    assert not is_plausible(flat)  # timed while something else held the machine: not cached
    assert model.context_coef == pytest.approx(1e-6, rel=0.01)
    for n, cached in [(1, 0), (4, 0), (64, 0), (1, 3000), (8, 500), (16, 100)]:
        reads = attention_reads(cached, n)
        assert model.predict(n, reads) == pytest.approx(fake_timer(n, cached), rel=0.05)
    # Verify-shaped batches: every token a logits row costing 0.01 more than the one-row curve.
    rows = measure(
        engine.runner,
        engine.block_manager,
        64,
        engine.max_model_len,
        timer=fake_timer,
        batch_timer=lambda seqs, tokens: (
            0.2 * max(1.0, seqs * tokens / 8)
            + 1e-6 * seqs * attention_reads(0, tokens)
            + 0.01 * (seqs * tokens - 1)
        ),
    ).model
    assert model.row_coef == 0.0 and rows.row_coef == pytest.approx(0.01, rel=0.05)
    assert rows.predict(16, 0, 16) == pytest.approx(model.predict(16, 0) + 0.15, rel=0.01)
    real = measure(engine.runner, engine.block_manager, 16, engine.max_model_len, repeats=1).model
    assert real.predict(1) > 0 and real.grid[-1] == 16
    # The CPU's attention reads each query's keys in turn: one context slope for every n.
    assert model.context_grid is None and real.context_grid is None
    assert engine.block_manager.num_used_blocks == 0


def test_calibration_times_every_verify_size_of_one_request(target) -> None:
    # A fifth row costing a second pass over the weights (AVX2's four-row tiles): the grid's 4
    # and 8 alone would price 5 tokens at 0.5 and 6 at 0.6; each size up to 1 + K is timed.
    engine = _engine_llm(target, "ngram", mode="always").engine  # K = 4: sizes 1 to 5

    def two_passes(n: int, context: int) -> float:
        return 0.1 * n + (0.2 if n > 4 else 0.0)

    model = measure(engine.runner, engine.block_manager, 64, engine.max_model_len, timer=two_passes)
    assert {1, 2, 3, 4, 5} <= set(model.model.grid)
    for n in (1, 2, 3, 4, 5):
        assert model.model.predict(n) == pytest.approx(two_passes(n, 0))
    assert engine.block_manager.num_used_blocks == 0


def test_steps_and_shapes_count_the_attentions_kv_reads(target) -> None:
    """The context the step-time model prices is what attention reads: a prompt of P tokens
    P (P + 1) / 2, a decode token after s cached positions s + 1, a verify of 1 + k tokens
    (1 + k) s + (1 + k)(2 + k) / 2; the scheduler's shape says the same before drafts, and
    prices each draft at a decoding sequence's length."""
    llm = _engine_llm(target, "ngram", mode="always")
    engine = llm.engine
    stats_seen, shapes_checked = [], 0
    observe, decide = engine.policy.observe, engine.policy.decide

    def record_stats(stats):
        stats_seen.append(stats)
        observe(stats)

    def check_shape(candidates, shape):
        nonlocal shapes_checked
        (c,) = candidates
        assert shape.context == attention_reads(c.request.num_computed_tokens, 1)
        assert shape.reads_per_draft == c.request.num_tokens
        assert shape.context_with(3) == shape.context + 3 * c.request.num_tokens
        shapes_checked += 1
        return decide(candidates, shape)

    engine.policy.observe = record_stats
    engine.policy.decide = check_shape
    prompt = [5, 6, 7, 8] * 6
    engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    (request,) = engine.scheduler.waiting
    while engine.has_unfinished_requests():
        cached = request.num_computed_tokens
        engine.step()
        stats = stats_seen[-1]
        assert stats.context == attention_reads(cached, stats.num_tokens)
    assert stats_seen[0].context == len(prompt) * (len(prompt) + 1) // 2
    assert shapes_checked > 0 and any(s.num_tokens > 1 for s in stats_seen[1:])  # verified


def test_steps_count_their_seconds_and_tokens_under_the_mode_they_ran_in(target) -> None:
    """A switch between steps splits the counts: each step's seconds and generated tokens go to
    the mode it was decided in, and the modes' tokens add up to every token generated."""
    llm = _engine_llm(target, "ngram", mode="always")
    engine = llm.engine
    stats_seen = []
    observe = engine.policy.observe

    def record_stats(stats):
        stats_seen.append(stats)
        observe(stats)

    engine.policy.observe = record_stats
    prompt = [5, 6, 7, 8] * 6
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    engine.add_request("a", prompt, params)
    engine.add_request("b", prompt[::-1], params)
    for _ in range(4):
        engine.step()
    engine.set_speculation_mode("off")
    while engine.has_unfinished_requests():
        engine.step()
    modes = [s.mode for s in stats_seen]
    assert modes == ["always"] * 4 + ["off"] * (len(stats_seen) - 4)
    policy = engine.policy_stats
    for mode in ("always", "off"):
        steps = [s for s in stats_seen if s.mode == mode]
        assert policy.mode_tokens[mode] == sum(s.num_generated for s in steps) > 0
        assert policy.mode_seconds[mode] == pytest.approx(sum(s.seconds for s in steps))
    assert policy.mode_tokens["always"] > 2 * 4  # drafts accepted: more than a token a step
    assert sum(policy.mode_tokens.values()) == engine.metrics.num_generation_tokens == 60


def test_a_long_prompt_is_caught_up_in_chunks_and_drafts_exactly(target) -> None:
    """A self-draft behind on a 150-token prompt: the draft model's forwards never carry more
    than the step's chunk of catch-up (16 tokens here), the request drafts once caught up, every
    draft is accepted (its draft KV is exact), and the output is plain greedy decoding's."""
    prompt = [(7 * i) % 50 + 3 for i in range(150)]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    plain = _engine_llm(target, "draft_model", draft=target, mode="off")
    expected = plain.generate([prompt], params)[0].outputs[0].token_ids
    llm = _engine_llm(target, "draft_model", draft=target)
    engine = llm.engine
    policy = engine.policy
    policy.step_model = FlatThenLinear()
    policy.costs.draft_forward_seconds = 0.0
    policy.costs.catch_up_seconds_per_token = 1.0 / 32  # half a 1 s step: MIN_CATCH_UP_CHUNK
    timings, decisions = [], []
    observe = engine.policy.observe

    def record(stats) -> None:
        observe(stats)
        timings.append(stats.draft_timing)
        decisions.extend(stats.decisions)
        # The fake's times, not the tiny model's real ones (milliseconds against its 1 s step):
        # no per-token cost or correction learned from them.
        policy.costs.catch_up_seconds_per_token = 1.0 / 32
        policy.costs._error = {True: 1.0, False: 1.0}

    engine.policy.observe = record  # type: ignore[method-assign]
    output = llm.generate([prompt], params)[0].outputs[0].token_ids
    assert output == expected
    catch_ups = [t.num_catch_up for t in timings if t is not None]
    assert catch_ups and max(catch_ups) <= 16
    reasons = [d.reason for d in decisions]
    assert reasons.count("catch_up") >= 150 // 16 - 1  # the prompt, a chunk a step
    assert reasons.index("goodput") > reasons.index("catch_up")
    stats = engine.spec_stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens
    assert engine.block_manager.num_used_blocks == 0
