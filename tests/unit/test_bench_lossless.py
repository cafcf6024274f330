"""bench/lossless.py's parts: the engine settings each run gets, the staggered driver (outputs
whole, in prompt order, no leaked blocks) and the comparison it reports."""

from __future__ import annotations

from bench import lossless
from engine import LLM, SamplingParams
from tests.conftest import ngram_llm

CONFIG = {
    "engine": {
        "model": "m",
        "gguf_activations": "int8",
        "speculative_config": {"method": "ngram+draft_model", "model": "d", "mode": "auto"},
    }
}


def test_each_run_gets_the_configs_engine_with_its_chain_and_mode() -> None:
    off = lossless.engine_kwargs(CONFIG, None, "off")
    assert off == {"model": "m", "gguf_activations": "int8"}  # no speculation at all
    ngram = lossless.engine_kwargs(CONFIG, "ngram", "always")
    assert ngram["speculative_config"] == {"method": "ngram", "mode": "always"}
    draft = lossless.engine_kwargs(CONFIG, "draft_model", "auto")
    assert draft["speculative_config"] == {"method": "draft_model", "model": "d", "mode": "auto"}
    assert CONFIG["engine"]["speculative_config"]["method"] == "ngram+draft_model"  # untouched


def test_first_difference() -> None:
    assert lossless.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert lossless.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert lossless.first_difference([1, 2], [1, 2, 3]) == 2  # one stopped early


def test_staggered_outputs_are_whole_and_equal_to_each_asked_alone(tiny_llama) -> None:
    """The driver adds up each request's deltas: with n-gram drafts in mode always and the
    prompts arriving two steps apart, every output equals that prompt asked alone, speculation
    off (outputs of many tokens, so a driver that kept one step's delta fails)."""
    prompts = [[5, 6, 7, 8] * 4, [9, 3, 9, 3, 9, 3], [4, 4, 2, 7, 1]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = LLM(str(tiny_llama), dtype="float32", max_num_seqs=1)
    expected = [lossless.run_staggered(alone, [p], params, 0)[0] for p in prompts]
    assert [len(e) for e in expected] == [24, 24, 24]
    llm = ngram_llm(tiny_llama, "always", num_speculative_tokens=3, prompt_lookup_min=1)
    assert lossless.run_staggered(llm, prompts, params, 2) == expected
    assert llm.engine.spec_stats.num_draft_tokens > 0
