"""The EAGLE-3 trainer's data: the features recorded while the tiny target generates are bit for
bit the feature pass's (and loading them runs the target over none of the sequences), the
prompts file's formats, the draft vocabulary's fill order, and the prompts `make eagle3-head`
ships."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine import LLM
from engine.training.eagle3_data import Example, draft_vocabulary, read_prompts
from engine.training.eagle3_data import TrainSequence as Seq
from tests.conftest import TINY_VOCAB
from tests.unit.train_eagle3_helpers import _engine, _prompts, build_target, single_thread


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    yield from single_thread()


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return build_target(tmp_path_factory)


def test_features_recorded_while_generating_are_the_feature_pass_bits(target, tmp_path):
    """The taps, final hidden states and argmaxes recorded while the target generates (prompt
    chunks beside decodes, 16-token steps) are bit for bit what running the target over each
    finished sequence gives, at every position training reads; load_features takes them and
    runs the target over none of these sequences."""
    from engine.training import eagle3_features
    from engine.training.eagle3_data import Example
    from engine.training.eagle3_features import make_sequences, sequence_features

    llm = LLM(**{**_engine(target), "enable_prefix_caching": False})
    taps = (1, 2, 3)
    examples = [Example(tuple(p)) for p in _prompts(3, 6)]
    features = tmp_path / "features"
    seqs = make_sequences(llm, examples, tmp_path / "seqs.jsonl", 12, 64, 0.0, 0, taps, features)
    assert len(seqs) == 6 and len(list((features / "recorded").glob("*.pt"))) == 6
    engine = llm.engine
    for seq in seqs:
        recorded = torch.load(eagle3_features._recorded_file(features, seq), weights_only=True)
        passed = sequence_features(engine.runner, engine.block_manager, seq, taps, 16)
        n, p = len(seq.token_ids), seq.num_prompt_tokens
        assert torch.equal(recorded["token_ids"], passed["token_ids"])
        assert torch.equal(recorded["loss_mask"], passed["loss_mask"])
        for key in ("aux", "hidden"):  # the last token is never fed while generating
            assert torch.equal(recorded[key][: n - 1], passed[key][: n - 1]), key
        assert torch.equal(
            recorded["target_ids"][p - 1 : n - 1], passed["target_ids"][p - 1 : n - 1]
        )

    def no_pass(*args, **kwargs):
        raise AssertionError("the target ran over a recorded sequence")

    original = eagle3_features.sequence_features
    eagle3_features.sequence_features = no_pass
    try:
        loaded = eagle3_features.load_features(llm, seqs, taps, features, 4)
    finally:
        eagle3_features.sequence_features = original
    assert len(loaded) == 6 and not list((features / "recorded").glob("*.pt"))


class _Tokenizer:
    """Characters as ids; a chat template of '<role>: content' lines."""

    chat_template = "fake"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [1] * add_special_tokens + [ord(c) % 200 + 3 for c in text]

    def apply_chat_template(self, conversation, add_generation_prompt, **_):
        text = "".join(f"{m['role']}: {m['content']}\n" for m in conversation)
        return self.encode(text + "assistant: " * add_generation_prompt)


def test_prompts_file_formats(tmp_path):
    tok = _Tokenizer()
    file = tmp_path / "prompts.jsonl"
    rows = [
        "a plain line",
        json.dumps({"prompt": "hi", "response": "yo"}),
        json.dumps({"messages": [{"role": "user", "content": "hi"}]}),
        json.dumps({"prompt_ids": [1, 5, 6], "response_ids": [7]}),
        "",
    ]
    file.write_text("\n".join(rows))
    examples = read_prompts(file, tok, TINY_VOCAB)
    assert examples == [
        Example(tuple(tok.encode("a plain line"))),
        Example(tuple(tok.encode("hi")), tuple(tok.encode("yo", add_special_tokens=False))),
        Example(tuple(tok.encode("user: hi\nassistant: "))),
        Example((1, 5, 6), (7,)),
    ]
    with pytest.raises(ValueError, match=r"prompts.jsonl:1: .*no tokenizer"):
        read_prompts(file, None, TINY_VOCAB)
    file.write_text(json.dumps({"prompt_ids": [1, TINY_VOCAB]}))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        read_prompts(file, tok, TINY_VOCAB)


def test_draft_vocabulary_counts_responses_then_fills():
    seqs = [Seq((9, 9, 4, 4, 4, 7), 2), Seq((8, 8, 8, 7, 4), 3)]
    # Responses: 4 x4, 7 x2; then the prompts' 8 (x3) before 9 (x2); then the smallest ids.
    assert draft_vocabulary(seqs, 2, 20) == [4, 7]
    assert draft_vocabulary(seqs, 3, 20) == [4, 7, 8]
    assert draft_vocabulary(seqs, 6, 20) == [0, 1, 4, 7, 8, 9]


def test_the_shipped_prompts_are_seeded_chat_examples(tmp_path):
    """`make eagle3-head`'s prompts: code tasks over standard-library functions and open-chat
    questions, three to one, the same for the same seed, read by the trainer's prompts parser."""
    from engine.training.prompts import build_prompts, main

    first, again = build_prompts(40, seed=3), build_prompts(40, seed=3)
    assert first == again and first != build_prompts(40, seed=4)
    contents = [p["messages"][0]["content"] for p in first]
    assert len(set(contents)) == 40
    assert sum("```python" in c for c in contents) == 30
    out = tmp_path / "prompts.jsonl"
    assert main(["--num", "12", "--out", str(out)]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 12 and all(line["messages"][0]["role"] == "user" for line in lines)
