"""The operator's utilization limit is judged against mode auto's calibrated knee; a policy that
has none (modes always and off) must not read every step as saturated."""

from __future__ import annotations

import logging

from engine import LLM, SamplingParams


def test_the_utilization_limit_without_calibration_is_not_applied(tiny_llama, caplog):
    config = {
        "method": "ngram",
        "mode": "always",
        "num_speculative_tokens": 3,
        "prompt_lookup_min": 1,
        "spec_disable_utilization": 0.5,
    }
    with caplog.at_level(logging.WARNING, logger="engine.speculation.speculator"):
        llm = LLM(
            str(tiny_llama),
            dtype="float32",
            block_size=4,
            num_kv_blocks=128,
            max_model_len=256,
            speculative_config=config,
        )
    assert "spec_disable_utilization 0.50 is not applied" in caplog.text
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8]  # repeats: n-gram lookup always finds a draft
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24))
    # With the placeholder knee of one token every step would read as saturated: no drafts.
    assert llm.engine.spec_stats.num_draft_tokens > 0
