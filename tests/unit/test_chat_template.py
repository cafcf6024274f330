"""Chat templates (rendered as a string and as parts, control tokens in content kept as text,
bad messages refused), loading a tokenizer directory and its eos ids, on a byte-level BPE trained
in the test (no downloads)."""

from __future__ import annotations

import json

import pytest
from transformers import PreTrainedTokenizerFast

from engine.text.tokenizer import apply_chat_template, eos_token_ids, load_tokenizer
from tests.tiny_tokenizers import CHATML_SPECIALS, SAMPLE_CORPUS, byte_level_bpe

CORPUS = SAMPLE_CORPUS
SPECIAL_TOKENS = CHATML_SPECIALS
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _byte_level() -> PreTrainedTokenizerFast:
    return byte_level_bpe(CORPUS, 330, SPECIAL_TOKENS)


@pytest.fixture(scope="module")
def byte_level() -> PreTrainedTokenizerFast:
    return _byte_level()


def _decode(tokenizer, ids, skip_special_tokens=True) -> str:
    return tokenizer.decode(
        ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
    )


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture()
def chat_tokenizer() -> PreTrainedTokenizerFast:
    tokenizer = _byte_level()
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def test_chat_template_string_and_parts(chat_tokenizer):
    messages = [
        {"role": "developer", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "🙂"}],
        },
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "And?"},
    ]
    ids = apply_chat_template(chat_tokenizer, messages)
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi\n🙂<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nAnd?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert type(ids) is list and all(type(t) is int for t in ids)
    assert ids == chat_tokenizer.encode(expected, add_special_tokens=False)
    no_prompt = apply_chat_template(chat_tokenizer, messages[:1], add_generation_prompt=False)
    assert _decode(chat_tokenizer, no_prompt, skip_special_tokens=False).endswith("<|im_end|>\n")


def test_chat_template_encodes_control_tokens_in_content_as_text(chat_tokenizer):
    im_end = chat_tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = apply_chat_template(chat_tokenizer, [{"role": "user", "content": "x<|im_end|>"}])
    assert ids.count(im_end) == 1  # only the one the template writes
    assert "x<|im_end|><|im_end|>" in _decode(chat_tokenizer, ids, skip_special_tokens=False)


@pytest.mark.parametrize(
    "messages, match",
    [
        ([{"role": "function", "content": "x"}], "role"),
        ([{"content": "x"}], "role"),
        ([{"role": "user", "content": 3}], "content"),
        ([{"role": "user", "content": None}], "content"),
        ([{"role": "user", "content": []}], "content"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}], "text"),
        ([{"role": "user", "content": [{"type": "text"}]}], "text"),
        (["hello"], "object"),
        ([], "non-empty"),
    ],
)
def test_chat_template_rejects_bad_messages(chat_tokenizer, messages, match):
    with pytest.raises(ValueError, match=match):
        apply_chat_template(chat_tokenizer, messages)


def test_chat_template_missing_or_raising(byte_level, chat_tokenizer):
    with pytest.raises(ValueError, match="no chat template"):
        apply_chat_template(byte_level, [{"role": "user", "content": "x"}])
    chat_tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(ValueError, match="roles must alternate"):
        apply_chat_template(chat_tokenizer, [{"role": "user", "content": "x"}])


def test_load_tokenizer_and_eos_ids(chat_tokenizer, tmp_path):
    chat_tokenizer.save_pretrained(tmp_path)
    loaded = load_tokenizer(tmp_path)
    text = "Un café 中文 🙂"
    assert loaded.encode(text, add_special_tokens=False) == _encode(chat_tokenizer, text)
    messages = [{"role": "user", "content": "Hi"}]
    assert apply_chat_template(loaded, messages) == apply_chat_template(chat_tokenizer, messages)

    eos = chat_tokenizer.convert_tokens_to_ids("<|endoftext|>")
    im_end = chat_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert eos_token_ids(loaded, tmp_path) == (eos,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [im_end, eos]}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert eos_token_ids(loaded, tmp_path) == (eos, im_end, 7)
    assert eos_token_ids(loaded, tmp_path / "config.json") == (eos, 7)
    assert eos_token_ids(loaded, None) == (eos,)
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / "missing")
