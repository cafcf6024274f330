"""bench/drafters.py: each drafter's speculative config is the deployment's turned to that
drafter, and a run on a tiny target and head reports every cell with its counters, each answer
compared with speculation-off's (equal token for token in float32), each cell's rounds on every
drafter in turn added up."""

from __future__ import annotations

import json

import pytest
import yaml

from bench import drafters
from engine import LLM
from tests.conftest import build_tiny_model
from tests.eagle3_heads import build_tiny_eagle3_head

BASE = {
    "method": "ngram+draft_model",
    "model": "qwen2.5-coder-0.5b-instruct",
    "num_speculative_tokens": 5,
}


def test_each_drafter_gets_its_own_speculative_config() -> None:
    assert drafters.speculative_config("off", BASE, "/h", None, "auto") is None
    ngram = drafters.speculative_config("ngram", BASE, "/h", None, "auto")
    assert ngram == {"method": "ngram", "mode": "auto", "num_speculative_tokens": 5}
    draft = drafters.speculative_config("draft_model", BASE, None, None, "always")
    assert draft["model"] == BASE["model"] and draft["mode"] == "always"
    head = drafters.speculative_config("ngram+eagle3", BASE, "/h", None, "auto")
    assert head["model"] == "/h" and head["draft_quantization"] == "q8_0"
    assert "draft_dtype" not in head
    q6 = drafters.speculative_config("eagle3", BASE, "/h", None, "auto", "q6_k")
    assert q6["draft_quantization"] == "q6_k"
    typed = drafters.speculative_config("eagle3", BASE, "/h", "bfloat16", "auto", "q6_k")
    assert typed["draft_dtype"] == "bfloat16" and "draft_quantization" not in typed
    with pytest.raises(ValueError, match="needs --head"):
        drafters.speculative_config("eagle3", BASE, None, None, "auto")
    with pytest.raises(ValueError, match="unknown drafter"):
        drafters.speculative_config("medusa", BASE, "/h", None, "auto")


def test_a_run_reports_every_cell_against_off(tmp_path, monkeypatch, capsys) -> None:
    target = build_tiny_model(tmp_path / "target", "llama", seed=4, num_hidden_layers=4)
    head = build_tiny_eagle3_head(tmp_path / "head", target, aux_layer_ids=[1, 2, 3])
    config = tmp_path / "config.yaml"
    engine = {
        "model": str(target),
        "dtype": "float32",
        "block_size": 4,
        "num_kv_blocks": 256,
        "max_model_len": 256,
        "max_num_seqs": 4,
        "speculative_config": {
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_min": 1,
            "draft_min_confidence": 0.0,
        },
    }
    config.write_text(yaml.safe_dump({"engine": engine}))
    # The tiny target has no tokenizer: each text becomes ids of its own, the template skipped.
    monkeypatch.setattr(
        drafters,
        "apply_chat_template",
        lambda tokenizer, messages: [1] + [3 + ord(c) % 90 for c in messages[0]["content"][:24]],
    )
    monkeypatch.setattr(LLM, "get_tokenizer", lambda self: None)
    out = tmp_path / "drafters.json"
    argv = [
        "--config", str(config), "--head", str(head), "--head-dtype", "float32",
        "--drafters", "off,eagle3,ngram+eagle3", "--workloads", "copy",
        "--concurrency", "1,3", "--requests", "2", "--max-tokens", "10", "--rounds", "2", "--mode", "always",
        "--out", str(out),
    ]  # fmt: skip
    assert drafters.main(argv) == 0
    report = json.loads(out.read_text())
    rows = {(r["drafter"], r["workload"], r["concurrency"]): r for r in report["rows"]}
    assert set(rows) == {
        (d, w, c) for d in ("off", "eagle3", "ngram+eagle3") for w in ("copy",) for c in (1, 3)
    }
    for (drafter, _, c), row in rows.items():
        assert row["answers"] == max(2, c)
        assert row["answers_equal_to_off"] == row["answers"]  # float32: lossless, exactly
        assert row["rounds"] == 2 and row["rounds_agree"] and len(row["tokens_per_s_by_round"]) == 2
        assert 0 < row["tokens"] <= 2 * row["answers"] * 10  # two rounds
        if drafter == "off":
            assert row["draft_tokens"] == 0 and row["mean_acceptance_length"] is None
            assert row["vs_off"] == 1.0
        elif "eagle3" in drafter:  # the head drafts in every step of mode always
            assert row["draft_tokens"] > 0 and row["verify_steps_with_drafts"] > 0
            expected = 1 + row["accepted_tokens"] / row["verify_steps_with_drafts"]
            assert row["mean_acceptance_length"] == pytest.approx(expected)
            assert "speculate/fixed" in row["decisions"]  # mode always: k fixed, budget allowing
            assert set(row["decisions"]) <= {"speculate/fixed", "skip/budget"}
    assert report["speculative_configs"]["eagle3"]["draft_dtype"] == "float32"
    assert "ngram+eagle3" in capsys.readouterr().out
