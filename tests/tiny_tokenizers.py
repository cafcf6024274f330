"""Tiny tokenizers trained in the tests (no downloads): byte-level BPE (GPT-2/Qwen style),
Llama-style BPE with byte fallback, and a SentencePiece-like Metaspace BPE."""

from __future__ import annotations

import json
from collections.abc import Sequence

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

# Text with multi-byte characters (accented Latin, CJK, emoji) and code, and the specials a
# ChatML template needs: what the detokenizer and chat-template tests train their tokenizers on.
SAMPLE_CORPUS = [
    "Hello world, the quick brown fox jumps over the lazy dog.",
    "A café in the town: naïve résumé, déjà vu.",
    "中文 文本 测试 中文 我们 你好",
    "emoji 🙂 smile 🙂🙂 done",
    "print(x) if x else None  # code",
] * 10
CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def byte_level_bpe(
    corpus: Sequence[str], vocab_size: int, special_tokens: Sequence[str]
) -> PreTrainedTokenizerFast:
    """Byte-level BPE; special_tokens[0] is the eos token. A small vocabulary keeps many
    multi-byte characters split over several tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=special_tokens[0],
        additional_special_tokens=list(special_tokens[1:]),
    )


def llama_byte_fallback(corpus: Sequence[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """ "▁"-joined BPE trained on ASCII text, every other character falling back to <0xXX>."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator([line.encode("ascii", "ignore").decode() for line in corpus], trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")


def metaspace_bpe(corpus: Sequence[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """SentencePiece-style BPE: words marked with a leading "▁"."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")


# A 32-token vocabulary of JSON pieces, built by hand (no training, so every id is known): the
# specials, single characters, and merges whose results are multi-character pieces. Encoding is
# plain BPE over the whole text (no pre-tokenizer), and token strings are the text itself.
JSON_SPECIALS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2: unk, bos, eos (the tiny models' ids)
JSON_CHARS = list('{}":, kab12[]nultre')
JSON_MERGES = [
    ("{", '"'),
    ("k", '"'),
    (":", " "),
    (": ", '"'),
    ('{"', 'k"'),
    ('{"k"', ': "'),
    ("a", "b"),
    ("b", "a"),
    ("b", "b"),
    ('"', "}"),
]


def json_pieces(
    chars: Sequence[str] = JSON_CHARS, merges: Sequence[tuple[str, str]] = JSON_MERGES
) -> PreTrainedTokenizerFast:
    """A hand-built BPE over JSON pieces: ids are JSON_SPECIALS, then `chars`, then one token per
    merge (by default 32 tokens, where '{"k": "ab"}' is ['{"k": "', 'ab', '"}'])."""
    pieces = [*JSON_SPECIALS, *chars, *(a + b for a, b in merges)]
    vocab = {piece: i for i, piece in enumerate(pieces)}
    assert len(vocab) == len(pieces), "a piece is listed twice"
    tok = Tokenizer(models.BPE(vocab=vocab, merges=list(merges), unk_token="<unk>"))
    tok.add_special_tokens(JSON_SPECIALS)
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
