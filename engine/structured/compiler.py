"""`GrammarCompiler`: a `StructuredOutput` compiled against the model's tokenizer.

Built on xgrammar, chosen by measuring the per-token mask cost at the Qwen vocabulary (151,936
tokens) on a CPU against llguidance (`bench/structured/grammar_mask.py`; figures in docs/performance.md). Compiling
costs milliseconds to seconds for a big schema, so the server compiles off the engine thread
(its tokenizer worker) and the engine, adding the request, finds the grammar in this cache. The
cache is an LRU keyed by the constraint; its lock is held for dictionary operations only, never
across a compilation (two threads compiling one new schema at once both succeed; one result is
kept).
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.errors import InvalidRequestError
from engine.structured.masks import pack_masks
from engine.structured.schema_check import schemas_in_structural_tag, unenforced_keyword
from engine.structured.spec import StructuredOutput

# Distinct constraints kept compiled (a compiled grammar is kilobytes to a few megabytes).
DEFAULT_CACHE_SIZE = 256
# xgrammar prefixes its messages with "[time] path/file.cc:line: ".
_LOCATION = re.compile(r"^\[[^\]]*\]\s+\S+:\d+:\s*")
# JSON separators of every constrained output: compact, and no whitespace anywhere else.
SEPARATORS = (", ", ": ")
# Bytes no token of a constrained output may hold: JSON allows no raw control character (in a
# string it must be escaped), and tool-call tags need only the newline. xgrammar's rule for
# length-bounded strings lets them through, so every grammar's masks are also ANDed with this.
_CONTROL_BYTES = frozenset(range(0x20)) - {0x0A}


@dataclass(frozen=True)
class CompiledGrammar:
    """A compiled constraint: the xgrammar grammar, and the tokens no output may hold."""

    grammar: Any  # xgrammar.CompiledGrammar
    # [mask_width(vocab)] int32 packed: tokens free of control bytes, and no special token but
    # the stop tokens
    allowed: torch.Tensor


class GrammarCompiler:
    """Compiles structured-output constraints for one tokenizer; thread-safe."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(t for t in stop_token_ids if 0 <= t < vocab_size)
        self._cache_size = cache_size
        self._cache: OrderedDict[StructuredOutput, Any] = OrderedDict()
        self._lock = threading.Lock()
        # Built on first use (the tokenizer scan takes ~0.5 s at a 150k vocabulary).
        self._compiler: tuple[Any, torch.Tensor] | None = None

    def compile(
        self, structured: StructuredOutput, param: str = "response_format"
    ) -> CompiledGrammar:
        """The compiled grammar. A schema xgrammar rejects (an unsupported feature, an invalid
        schema) raises InvalidRequestError naming `param`."""
        with self._lock:
            compiled = self._cache.get(structured)
            if compiled is not None:
                self._cache.move_to_end(structured)
                return compiled
        compiler, allowed = self._xgrammar_compiler()
        try:
            compiled = CompiledGrammar(_compile(compiler, structured), allowed)
        except (RuntimeError, ValueError, TypeError) as e:
            message = _LOCATION.sub("", str(e).strip()).splitlines()[0] if str(e) else repr(e)
            raise InvalidRequestError(
                f"the {structured.kind.replace('_', ' ')} cannot be used: {message}", param
            ) from None
        with self._lock:
            self._cache[structured] = compiled
            self._cache.move_to_end(structured)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    def _xgrammar_compiler(self) -> tuple[Any, torch.Tensor]:
        with self._lock:
            if self._compiler is None:
                import xgrammar

                info = xgrammar.TokenizerInfo.from_huggingface(
                    self._tokenizer,
                    vocab_size=self.vocab_size,
                    stop_token_ids=list(self.stop_token_ids) or None,
                )
                # Our own LRU caches results; xgrammar's cache would keep every schema forever.
                compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
                # xgrammar takes a special token as its literal text ("<|im_start|>" inside a
                # string), but the detokenizer skips special tokens: the output would lack text
                # the grammar counted. Only the stop tokens (the grammar's end) stay.
                specials = _special_token_ids(self._tokenizer) - set(self.stop_token_ids)
                self._compiler = (
                    compiler,
                    _allowed_tokens(info.decoded_vocab, self.vocab_size, specials),
                )
            return self._compiler


def _special_token_ids(tokenizer: Any) -> set[int]:
    """The ids `decode(..., skip_special_tokens=True)` drops: the named special tokens and
    every added token marked special."""
    ids = set(getattr(tokenizer, "all_special_ids", ()))
    added = getattr(tokenizer, "added_tokens_decoder", {})
    return ids | {i for i, token in added.items() if getattr(token, "special", False)}


def _allowed_tokens(
    decoded_vocab: Sequence[bytes], vocab_size: int, banned_ids: set[int]
) -> torch.Tensor:
    """[mask_width(vocab_size)] int32 packed: the tokens whose bytes hold no control byte and
    whose id is not banned (ids past the decoded vocabulary stay allowed: the grammar's own mask
    rules them out)."""
    allowed = torch.ones(vocab_size, dtype=torch.bool, device="cpu")
    num_decoded = min(len(decoded_vocab), vocab_size)
    allowed[:num_decoded] = torch.tensor(
        [not _CONTROL_BYTES.intersection(b) for b in decoded_vocab[:num_decoded]],
        dtype=torch.bool,
        device="cpu",
    )
    allowed[[i for i in banned_ids if 0 <= i < vocab_size]] = False
    return pack_masks(allowed.unsqueeze(0))[0]


def _check_enforceable(structured: StructuredOutput) -> None:
    if structured.kind == "json_object":
        return
    value = json.loads(structured.spec)
    schemas = [value] if structured.kind == "json_schema" else schemas_in_structural_tag(value)
    for schema in schemas:
        found = unenforced_keyword(schema)
        if found:
            raise ValueError(f"it uses {found}, which structured outputs cannot enforce")


def _compile(compiler: Any, structured: StructuredOutput) -> Any:
    _check_enforceable(structured)
    if structured.kind == "json_object":
        # Any object; non-strict, so that its keys are free.
        return compiler.compile_json_schema(
            '{"type": "object"}', any_whitespace=False, separators=SEPARATORS, strict_mode=False
        )
    if structured.kind == "json_schema":
        return compiler.compile_json_schema(
            structured.spec, any_whitespace=False, separators=SEPARATORS, strict_mode=True
        )
    return compiler.compile_structural_tag(structured.spec)
