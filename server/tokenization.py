"""Chat templating and tokenisation of requests, off the event loop.

Rendering a chat template and encoding a long prompt take milliseconds to seconds of CPU; done
on the asyncio loop they would stall every stream the server is sending, and done by the engine
they would stall every request's next step. `PromptTokenizer` runs them on a thread of its own.
A Rust tokenizer is never shared between threads: the engine thread keeps the tokenizer it
loaded (its detokenizer), and each user here gets its own copy, made at start-up before the
engine thread runs (`copies`).
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from engine.tokenizer import apply_chat_template, encode_text


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
