"""bench/eagle3_cost.py's random head is in the published format with the target's shapes (our
loader takes it and drafts with it), and bench/policy/offline.py's run counts what it reports:
every request's tokens, the decisions of every decoding step, drafts per source."""

from __future__ import annotations

from bench import eagle3_cost
from bench.policy import offline as policy_offline
from engine import LLM, SamplingParams
from engine.models.config import ModelConfig
from tests.conftest import build_tiny_model


def test_the_random_head_loads_and_drafts(tmp_path) -> None:
    target = build_tiny_model(tmp_path / "target", "llama", seed=2, num_hidden_layers=8)
    head = eagle3_cost.random_head(ModelConfig.from_path(target), tmp_path / "head", 64)
    llm = LLM(
        str(target),
        dtype="float32",
        block_size=4,
        num_kv_blocks=64,
        max_model_len=128,
        speculative_config={
            "method": "eagle3",
            "model": str(head),
            "mode": "always",
            "num_speculative_tokens": 2,
            "draft_min_confidence": 0.0,
        },
    )
    llm.generate([[1, 5, 9, 13]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert llm.engine.spec_stats.by_source["eagle3"][0] > 0


def test_an_offline_run_counts_tokens_decisions_and_drafts(tmp_path, monkeypatch) -> None:
    target = build_tiny_model(tmp_path / "target", "llama", seed=2)
    config = {
        "model": str(target),
        "dtype": "float32",
        "block_size": 4,
        "num_kv_blocks": 128,
        "max_model_len": 256,
        "speculative_config": {"method": "ngram", "prompt_lookup_min": 1},
    }
    # The tiny target has no tokenizer: prompts go in as ids, and the chat template is skipped.
    prompt = [1, 7, 7, 8, 7, 7, 8]
    monkeypatch.setattr(policy_offline, "apply_chat_template", lambda tokenizer, m: prompt)
    monkeypatch.setattr(LLM, "get_tokenizer", lambda self: None)
    result = policy_offline.run(config, "always", ["a", "b"], 2, 4, 12)
    assert result["tokens"] == 4 * 12
    assert result["steps"] > 0 and result["decisions"]
    assert set(result["decisions"]) <= {"speculate/fixed", "skip/budget"}
    assert result["by_source"]["ngram"]["draft_tokens"] == result["draft_tokens"] > 0
