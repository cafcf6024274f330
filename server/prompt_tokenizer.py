"""Chat templating and tokenisation of requests, off the event loop.

Rendering a chat template and encoding a long prompt take milliseconds to seconds of CPU; done
on the asyncio loop they would stall every stream the server is sending, and done by the engine
they would stall every request's next step. `PromptTokenizer` runs them on a thread of its own.
A Rust tokenizer is never shared between threads: the engine thread keeps the tokenizer it
loaded (its detokenizer), and each user here gets its own copy, made at start-up before the
engine thread runs (`copies`). The /tokenize and /detokenize endpoints
(`server/routes/tokenize.py`) run on the same thread, so the ids they report are the generation
endpoints' own.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

from engine.text.tokenizer import apply_chat_template, encode_text


def copies(tokenizer: Any, count: int) -> list[Any]:
    """`count` independent copies of `tokenizer` (its Rust state included)."""
    return [copy.deepcopy(tokenizer) for _ in range(count)]


class PromptTokenizer:
    """Turns a request's messages or text into prompt token ids on one worker thread, with a
    tokenizer that thread alone uses."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        # One worker: the copy is only ever used by it.
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tokenize")

    async def chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """The prompt ids of `messages` (and `tools`) rendered by the model's chat template."""
        return await self._run(_render_chat, messages, tools)

    async def texts(self, prompts: Sequence[str | Sequence[int]]) -> list[str | Sequence[int]]:
        """Each text prompt encoded as the engine would (`encode_text`); id prompts as given."""
        if all(not isinstance(p, str) for p in prompts):
            return list(prompts)
        return await self._run(_encode_all, prompts)

    async def tokenize_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool,
        add_special_tokens: bool,
    ) -> list[int]:
        """`messages` rendered by the chat template (the ids of `chat` with a generation prompt
        and no special tokens), optionally wrapped in the tokenizer's special tokens."""
        render = partial(
            _chat_ids,
            add_generation_prompt=add_generation_prompt,
            add_special_tokens=add_special_tokens,
        )
        return await self._run(render, messages)

    async def tokenize_text(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """The ids of `text` (with special tokens: what `texts` gives /v1/completions)."""
        return await self._run(partial(_text_ids, add_special_tokens=add_special_tokens), text)

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        """The text of `token_ids`, special tokens included. Raises ValueError, naming
        `tokens`, for an id the tokenizer does not have."""
        return await self._run(_decode, token_ids)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _run(self, fn: Any, *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, fn, self._tokenizer, *args)


def _render_chat(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[int]:
    return apply_chat_template(tokenizer, messages, tools=tools)


def _encode_all(
    tokenizer: Any, prompts: Sequence[str | Sequence[int]]
) -> list[str | Sequence[int]]:
    return [encode_text(tokenizer, p) if isinstance(p, str) else p for p in prompts]


def _chat_ids(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool,
    add_special_tokens: bool,
) -> list[int]:
    ids = apply_chat_template(tokenizer, messages, add_generation_prompt)
    return _with_special_tokens(tokenizer, ids) if add_special_tokens else ids


def _text_ids(tokenizer: Any, text: str, *, add_special_tokens: bool) -> list[int]:
    if add_special_tokens:
        return encode_text(tokenizer, text)
    return list(tokenizer.encode(text, add_special_tokens=False))


def _with_special_tokens(tokenizer: Any, ids: list[int]) -> list[int]:
    """`ids` between the special tokens the tokenizer adds around one text (a bos, say).

    A rendered chat is tokenised without them and with its control tokens sanitised, so
    re-encoding its text would lose that; instead the tokens are found by encoding a probe with
    and without them (a tokenizer's post-processor only adds tokens around the text's own)."""
    plain = list(tokenizer.encode("a", add_special_tokens=False))
    full = list(tokenizer.encode("a", add_special_tokens=True))
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return full[:start] + ids + full[start + len(plain) :]
    raise ValueError("add_special_tokens cannot be applied to messages with this tokenizer.")


def _decode(tokenizer: Any, token_ids: Sequence[int]) -> str:
    num_ids = len(tokenizer)
    for i, token_id in enumerate(token_ids):
        if not 0 <= token_id < num_ids:
            raise ValueError(
                f"tokens[{i}] ({token_id}) is outside the tokenizer's vocabulary "
                f"(ids 0 to {num_ids - 1})."
            )
    # As the engine's detokenizer decodes, minus skipping: a chat's control tokens stay visible.
    return tokenizer.decode(
        list(token_ids), skip_special_tokens=False, clean_up_tokenization_spaces=False
    )
