"""`GrammarWorker`: structured-output grammars compiled off the event loop and off the engine
thread, so that a request's constraint the grammar library cannot use is a 400 before anything
runs, and the engine finds the compiled grammar in its compiler's cache.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from engine.errors import InvalidRequestError
from engine.structured import StructuredOutput
from engine.structured.compiler import GrammarCompiler
from server.errors import OpenAIError, invalid_request


class GrammarWorker:
    """Compiles requests' constraints on a thread of its own: never on the asyncio loop (a big
    schema takes seconds) and never on the engine thread, which then finds it in the compiler's
    cache. One thread: a client sending huge schemas queues behind itself, not ahead of
    tokenisation."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        self._compiler = compiler
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")

    async def compile(self, structured: StructuredOutput, param: str = "response_format") -> None:
        """Compile (or find cached); a constraint the grammar library cannot use is a 400."""
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self._pool, self._compiler.compile, structured, param)
        except InvalidRequestError as e:
            raise _invalid(e) from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _invalid(e: InvalidRequestError) -> OpenAIError:
    return invalid_request(str(e), e.param, code="invalid_schema")
