"""The text and raw bytes of single tokens, for logprobs.

OpenAI reports each token as its text plus its UTF-8 bytes, so that a client can rebuild
characters split over several tokens. `tokenizer.decode([id])` cannot give those bytes: a
token holding half of a character decodes to U+FFFD. So the bytes come from the vocabulary piece:
- byte-level BPE (GPT-2, Llama 3, Qwen): each piece character stands for one byte through the
  GPT-2 byte-to-unicode table;
- byte-fallback pieces `<0xE4>` (Llama 2, Mistral): that one byte;
- SentencePiece pieces: `▁` is a space;
- added and special tokens: their content;
- anything else: the UTF-8 of `decode([id])`.
The text is the bytes decoded as UTF-8 (U+FFFD for an incomplete character), so a piece keeps
its leading space ("▁Hello" -> " Hello") where `decode([id])` would strip it.
"""

from __future__ import annotations

import codecs
import json
import logging
import re
from collections.abc import Iterable
from typing import Any

logger = logging.getLogger(__name__)

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_METASPACE = "\u2581"


def _unicode_to_byte() -> dict[str, int]:
    """Inverse of the GPT-2 byte-level table: printable Latin-1 bytes stand for themselves,
    the other 68 bytes (control characters, space, soft hyphen...) for chr(256 + k) in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {chr(b): b for b in printable}
    shifted = (b for b in range(256) if b not in table.values())
    table.update({chr(256 + k): b for k, b in enumerate(shifted)})
    return table


_UNICODE_TO_BYTE = _unicode_to_byte()


class TokenDecoder:
    """Per-tokenizer cache of each token's (text, bytes). Build one per served model."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.is_byte_level = "ByteLevel" in _decoder_types(tokenizer)
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self._added: dict[int, str] = {int(i): str(t) for i, t in added.items()}
        self._cache: dict[int, tuple[str, bytes]] = {}

    def token_text(self, token_id: int) -> str:
        return self._entry(token_id)[0]

    def token_bytes(self, token_id: int) -> bytes:
        return self._entry(token_id)[1]

    def _entry(self, token_id: int) -> tuple[str, bytes]:
        entry = self._cache.get(token_id)
        if entry is None:
            raw = self._raw_bytes(token_id)
            entry = (raw.decode("utf-8", errors="replace"), raw)
            self._cache[token_id] = entry
        return entry

    def _raw_bytes(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode()
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str):
            return self._decoded(token_id)
        if self.is_byte_level and all(c in _UNICODE_TO_BYTE for c in piece):
            return bytes(_UNICODE_TO_BYTE[c] for c in piece)
        match = _BYTE_FALLBACK.fullmatch(piece)
        if match:
            return bytes([int(match.group(1), 16)])
        if _METASPACE in piece:
            return piece.replace(_METASPACE, " ").encode()
        return self._decoded(token_id)

    def _decoded(self, token_id: int) -> bytes:
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return str(text).encode()


class TextOffsets:
    """Running character offsets of one choice's tokens, for legacy completions logprobs.

    Offsets count characters of the text the tokens spell; a token that begins inside a
    character (byte-level pieces) gets that character's offset. Feed tokens in order, in any
    number of calls (a stream calls once per chunk)."""

    def __init__(self, tokens: TokenDecoder, start: int = 0) -> None:
        self._tokens = tokens
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.position = start

    def advance(self, token_ids: Iterable[int]) -> list[int]:
        offsets = []
        for token_id in token_ids:
            offsets.append(self.position)
            self.position += len(self._decoder.decode(self._tokens.token_bytes(token_id)))
        return offsets


def _decoder_types(tokenizer: Any) -> set[str]:
    """Types of the `tokenizers` decoder(s) of a fast tokenizer; empty if unknown."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if decoder is None:
        return set()
    try:
        state = json.loads(decoder.__getstate__())
    except (AttributeError, TypeError, ValueError):
        logger.debug("cannot read the decoder of %s", type(tokenizer).__name__)
        return set()
    types, stack = set(), [state]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            types.add(str(node.get("type")))
            stack.extend(node.get("decoders") or [])
    return types
