"""The engine's outputs are deltas: each step's carries only what that step added, the engine
never changes one after returning it, and added up they are what the offline API returns."""

from __future__ import annotations

import copy

from engine import SamplingParams
from engine.outputs import RequestOutput
from tests.conftest import ngram_llm

PROMPT = [7, 8, 9, 10, 11] * 6  # repetitive: the n-gram drafts are accepted, steps add several
PARAMS = SamplingParams(n=2, temperature=0, max_tokens=48, logprobs=2, ignore_eos=True)


def _counters(stats) -> tuple:
    """Speculation counters without the measured times, which differ from run to run."""
    return (
        stats.num_drafts,
        stats.num_draft_tokens,
        stats.num_accepted_tokens,
        stats.accepted_per_pos,
        stats.acceptance_histogram,
    )


def test_step_outputs_are_deltas_that_add_up_to_the_offline_output(tiny_llama):
    engine = ngram_llm(tiny_llama).engine
    engine.add_request("r", PROMPT, PARAMS)
    requests = engine._groups["r"].requests
    outputs: list[tuple[RequestOutput, RequestOutput]] = []  # (as returned, a copy taken then)
    num_before = [0, 0]
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs.append((output, copy.deepcopy(output)))
            for c, request in zip(output.outputs, requests, strict=True):
                gained = request.output_token_ids[num_before[c.index] :]
                assert c.token_ids == gained  # this step's tokens, not the whole output
                assert [e.token_id for e in c.logprobs] == gained
                assert c.num_output_tokens == request.num_output_tokens
                assert (c.spec_stats is not None) == c.finished
                num_before[c.index] = request.num_output_tokens
    # Later steps changed none of the outputs handed out before them.
    assert all(output == taken for output, taken in outputs)
    sizes = [len(o.outputs[0].token_ids) for o, _ in outputs]
    assert max(sizes) > 1 and sum(sizes) == PARAMS.max_tokens and len(sizes) < PARAMS.max_tokens

    (whole,) = ngram_llm(tiny_llama).generate([PROMPT], PARAMS)
    assert whole.finished and [c.index for c in whole.outputs] == [0, 1]
    for c in whole.outputs:
        deltas = [o.outputs[c.index] for o, _ in outputs]
        assert c.token_ids == [t for d in deltas for t in d.token_ids]
        assert len(c.token_ids) == c.num_output_tokens == PARAMS.max_tokens
        assert c.logprobs == [e for d in deltas for e in d.logprobs]
        assert c.text == "" and c.finish_reason == deltas[-1].finish_reason == "length"
        assert c.spec_stats is not None and c.spec_stats.num_accepted_tokens > 0
        assert _counters(c.spec_stats) == _counters(deltas[-1].spec_stats)
