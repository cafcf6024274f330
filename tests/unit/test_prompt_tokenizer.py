"""What /tokenize and /detokenize run (`PromptTokenizer`), on a byte-level BPE trained in the test
whose post-processor adds `<s>` before and `</s>` after a text, as many tokenizers do: the ids
with and without special tokens, chats with and without a generation prompt, and decoding."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from tokenizers import processors
from transformers import PreTrainedTokenizerFast

from server.prompt_tokenizer import PromptTokenizer
from tests.tiny_tokenizers import CHATML_SPECIALS, SAMPLE_CORPUS, byte_level_bpe
from tests.unit.test_chat_template import CHAT_TEMPLATE

MESSAGES = [{"role": "user", "content": "Hello world"}]
TEXT = "A café in the town 🙂"


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    tok = byte_level_bpe(SAMPLE_CORPUS, 330, [*CHATML_SPECIALS, "<s>", "</s>"])
    bos, eos = tok.convert_tokens_to_ids(["<s>", "</s>"])
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", bos), ("</s>", eos)]
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


@pytest.fixture()
def prompts(tokenizer) -> Iterator[PromptTokenizer]:
    prompt_tokenizer = PromptTokenizer(tokenizer)
    yield prompt_tokenizer
    prompt_tokenizer.close()


def test_text_with_and_without_special_tokens(tokenizer, prompts):
    bos, eos = tokenizer.convert_tokens_to_ids(["<s>", "</s>"])
    plain = tokenizer.encode(TEXT, add_special_tokens=False)
    with_specials = asyncio.run(prompts.tokenize_text(TEXT, add_special_tokens=True))
    assert with_specials == [bos, *plain, eos]
    # What /v1/completions sends the engine for the same text.
    assert with_specials == asyncio.run(prompts.texts([TEXT]))[0]
    assert asyncio.run(prompts.tokenize_text(TEXT, add_special_tokens=False)) == plain


def test_chat_ids(tokenizer, prompts):
    bos, eos = tokenizer.convert_tokens_to_ids(["<s>", "</s>"])

    async def tokenize(generation_prompt: bool, special_tokens: bool) -> list[int]:
        return await prompts.tokenize_chat(
            MESSAGES, add_generation_prompt=generation_prompt, add_special_tokens=special_tokens
        )

    chat = asyncio.run(prompts.chat(MESSAGES))  # what /v1/chat/completions sends the engine
    assert asyncio.run(tokenize(True, False)) == chat
    assert asyncio.run(tokenize(True, True)) == [bos, *chat, eos]
    header = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    assert asyncio.run(tokenize(False, False)) == chat[: -len(header)]
    assert asyncio.run(tokenize(False, True)) == [bos, *chat[: -len(header)], eos]


def test_detokenize_keeps_special_tokens(tokenizer, prompts):
    ids = asyncio.run(
        prompts.tokenize_chat(MESSAGES, add_generation_prompt=True, add_special_tokens=True)
    )
    text = asyncio.run(prompts.detokenize(ids))
    assert text == "<s><|im_start|>user\nHello world<|im_end|>\n<|im_start|>assistant\n</s>"
    text_ids = asyncio.run(prompts.tokenize_text(TEXT, add_special_tokens=False))
    assert asyncio.run(prompts.detokenize(text_ids)) == TEXT


@pytest.mark.parametrize("bad_id", [-1, 330, 10**9])
def test_detokenize_refuses_ids_outside_the_vocabulary(tokenizer, prompts, bad_id):
    assert len(tokenizer) == 330  # ids 0 to 329
    with pytest.raises(ValueError, match=r"^tokens\[1\] .* outside the tokenizer's vocabulary"):
        asyncio.run(prompts.detokenize([5, bad_id]))
    assert asyncio.run(prompts.detokenize([len(tokenizer) - 1]))  # the last id is one
