"""The operator's utilization limit is judged against mode auto's calibrated knee; a policy that
has none (modes always and off) must not read every step as saturated."""

from __future__ import annotations

import logging

from engine import SamplingParams
from tests.conftest import ngram_llm


def test_the_utilization_limit_without_calibration_is_not_applied(tiny_llama, caplog):
    with caplog.at_level(logging.WARNING, logger="engine.policy.setup"):
        llm = ngram_llm(tiny_llama, mode="always", spec_disable_utilization=0.5)
    assert "spec_disable_utilization 0.50 is not applied" in caplog.text
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8]  # repeats: n-gram lookup always finds a draft
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24))
    # With the placeholder knee of one token every step would read as saturated: no drafts.
    assert llm.engine.spec_stats.num_draft_tokens > 0
