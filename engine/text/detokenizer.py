"""Incremental detokenization with stop strings.

Two layers, both fed one token at a time (a speculative step appends several tokens, which are
walked one by one so that a stop string ends the output at the exact token that completed it):

1. Window decoding. Decoding one token alone loses context: SentencePiece decoders drop the
   leading space of the first token they see, and byte-level BPE tokens can hold part of a UTF-8
   character. So each step decodes a short window of recent tokens, `ids[prefix_offset:]`, and
   emits what it adds to the text already emitted for `ids[prefix_offset:read_offset]`. Text that
   ends in U+FFFD (an incomplete character) is held back until the character completes; the
   window then slides forward. The window starts with the last few prompt tokens, so the first
   output token is decoded as a continuation of the prompt (" Paris" after "capital of France
   is", as /v1/completions needs).
2. Stop strings. The stable text is scanned for stop strings; the longest suffix that could still
   grow into one is held back, so emitted text never contains (part of) a stop string.

Contract: when no stop string matches, the emitted pieces plus `flush()` equal
`tokenizer.decode(output_ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)` for
byte-level BPE tokenizers and for every tokenizer when the prompt is empty. With a prompt, a
SentencePiece-style decoder's removal of the first token's leading space does not apply (the
text is a continuation). Clean-up of tokenization spaces is never applied: it is not stable
under incremental decoding and corrupts text such as code. With byte-fallback (`<0xE4>`)
tokens, exactness assumes the byte tokens form valid UTF-8; invalid ones still give U+FFFD, in
possibly different numbers. When several stop strings occur, the one that completes first in the
text wins (the longest on a tie), which does not depend on how the text splits into tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

from transformers import PreTrainedTokenizerBase

from engine.sampling_params import SamplingParams

# Prompt tokens decoded as context before the first output token.
_NUM_PROMPT_CONTEXT_TOKENS = 5
# A text still ending in U+FFFD after this many tokens is taken as invalid UTF-8 and released, so
# garbage output cannot make the decode window (and the cost per token) grow without bound.
_MAX_PENDING_TOKENS = 16
# Bound on a window that keeps its start because its newer tokens decode to "" (see below).
_MAX_WINDOW_TOKENS = 24
_REPLACEMENT_CHAR = "\ufffd"


def backend_decoder(tokenizer: PreTrainedTokenizerBase) -> Callable[[list[int], bool], str] | None:
    """The Rust tokenizer's own `decode(ids, skip_special_tokens)` where the transformers
    tokenizer's decode, without clean-up, is exactly that call (a fast tokenizer that overrides
    neither `decode` nor `_decode`); else None. The engine thread detokenizes every stream's
    every token (two decodes each), and transformers' Python wrapper costs more than the decode
    itself (bench/detokenize.py measures both paths)."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if not getattr(tokenizer, "is_fast", False) or backend is None:
        return None
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend as Fast
    except ImportError:  # transformers 4: the fast tokenizers' base class had another name
        from transformers import PreTrainedTokenizerFast as Fast
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase as Base

    cls = type(tokenizer)
    if (
        not isinstance(tokenizer, Fast)
        or cls.decode is not Base.decode
        or cls._decode is not Fast._decode
    ):
        return None
    return cast(Callable[[list[int], bool], str], backend.decode)


@dataclass(frozen=True)
class DetokenizerUpdate:
    """What one `append` produced.

    `num_tokens_kept` is how many of the appended tokens belong to the output: all of them, or
    `j + 1` when a stop string completed at the j-th token (the rest are discarded).
    """

    text: str
    num_tokens_kept: int
    stop_string: str | None

    def __post_init__(self) -> None:
        if self.num_tokens_kept < 0:
            raise ValueError(f"num_tokens_kept must be >= 0, got {self.num_tokens_kept}.")


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text incrementally, honouring stop strings."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = params.skip_special_tokens
        self._backend_decode = backend_decoder(tokenizer)
        self._stop = params.stop
        self._max_stop_len = max((len(s) for s in self._stop), default=0)
        # Window state: ids[prefix_offset:read_offset] decode to `prefix_text`, all of it emitted
        # (or, for prompt tokens, never to be emitted). Ids before prefix_offset are dropped.
        start = max(0, len(prompt_token_ids) - _NUM_PROMPT_CONTEXT_TOKENS)
        self._ids: list[int] = [int(t) for t in prompt_token_ids[start:]]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        if self._prefix_text.endswith(_REPLACEMENT_CHAR):
            # The prompt ends inside a character; its text cannot serve as a stable prefix.
            self._ids, self._read_offset, self._prefix_text = [], 0, ""
        # Characters past `prefix_text` already released while the window still ended in U+FFFD.
        self._num_pending_chars_released = 0
        self._held_text = ""  # stable text held back as a possible stop-string start
        self._output_parts: list[str] = []
        self._stop_string: str | None = None
        self._is_finished = False

    @property
    def output_text(self) -> str:
        """All text emitted so far, flushed text included."""
        if len(self._output_parts) > 1:
            self._output_parts = ["".join(self._output_parts)]
        return self._output_parts[0] if self._output_parts else ""

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the output, if one did."""
        return self._stop_string

    def append(self, token_ids: Sequence[int]) -> DetokenizerUpdate:
        """Add new output tokens; return the text now safe to emit."""
        assert not self._is_finished, "append() after a stop string or flush()"
        pieces: list[str] = []
        for j, token_id in enumerate(token_ids):
            stable_text = self._decode_next(int(token_id))
            if not stable_text:
                continue
            text, stop_string = self._scan_for_stop(stable_text)
            pieces.append(text)
            if stop_string is not None:
                self._finish(stop_string)
                return self._emit(pieces, j + 1, stop_string)
        return self._emit(pieces, len(token_ids), None)

    def flush(self) -> str:
        """Release all held-back text; call once when the request ends without a stop string."""
        assert not self._is_finished, "flush() after a stop string or flush()"
        new_text = self._decode(self._ids[self._prefix_offset :])[len(self._prefix_text) :]
        # Held stop-string prefixes can no longer complete unless the incomplete tail does it.
        text = self._held_text + new_text[self._num_pending_chars_released :]
        self._held_text = ""
        match = self._find_stop(text)
        if match is not None:
            text = text[: match[0]]
            self._stop_string = match[1]
        self._is_finished = True
        self._output_parts.append(text)
        return text

    def _emit(self, pieces: list[str], num_tokens_kept: int, stop: str | None) -> DetokenizerUpdate:
        text = "".join(pieces)
        if text:
            self._output_parts.append(text)
        return DetokenizerUpdate(text=text, num_tokens_kept=num_tokens_kept, stop_string=stop)

    def _finish(self, stop_string: str) -> None:
        self._stop_string = stop_string
        self._is_finished = True
        self._held_text = ""

    def _decode(self, ids: list[int]) -> str:
        if self._backend_decode is not None:
            return cast(str, self._backend_decode(ids, self._skip_special_tokens))
        text = self._tokenizer.decode(
            ids, skip_special_tokens=self._skip_special_tokens, clean_up_tokenization_spaces=False
        )
        return cast(str, text)  # a flat id list decodes to one string

    def _decode_next(self, token_id: int) -> str:
        """Append one token to the window; return the text it makes final (may be empty)."""
        self._ids.append(token_id)
        window_text = self._decode(self._ids[self._prefix_offset :])
        new_text = window_text[len(self._prefix_text) :]
        num_pending_tokens = len(self._ids) - self._read_offset
        if new_text.endswith(_REPLACEMENT_CHAR) and num_pending_tokens < _MAX_PENDING_TOKENS:
            # Only the trailing run of U+FFFD can still change; what precedes it is final.
            num_stable_chars = len(new_text.rstrip(_REPLACEMENT_CHAR))
            released = self._num_pending_chars_released
            self._num_pending_chars_released = max(released, num_stable_chars)
            return new_text[released:num_stable_chars]
        text = new_text[self._num_pending_chars_released :]
        self._slide_window(window_text)
        return text

    def _slide_window(self, window_text: str) -> None:
        """Make the tokens just read the context of the next step.

        Context that decodes to "" (skipped special tokens, a lone "▁") would leave the next
        token first in its window, where SentencePiece decoders drop its leading space; then the
        window keeps its older start instead, up to `_MAX_WINDOW_TOKENS`.
        """
        prefix_text = self._decode(self._ids[self._read_offset :])
        if prefix_text or len(self._ids) - self._prefix_offset > _MAX_WINDOW_TOKENS:
            self._prefix_offset = self._read_offset
        else:
            prefix_text = window_text
        self._prefix_text = prefix_text
        self._read_offset = len(self._ids)
        self._num_pending_chars_released = 0
        del self._ids[: self._prefix_offset]
        self._read_offset -= self._prefix_offset
        self._prefix_offset = 0

    def _scan_for_stop(self, stable_text: str) -> tuple[str, str | None]:
        """Split held + new stable text into (text to emit, matched stop string or None)."""
        if not self._stop:
            return stable_text, None
        text = self._held_text + stable_text
        match = self._find_stop(text)
        if match is not None:
            return text[: match[0]], match[1]
        num_held = self._num_chars_to_hold(text)
        self._held_text = text[len(text) - num_held :]
        return text[: len(text) - num_held], None

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        """The stop string that completes first in `text` (longest on a tie), with its start.

        Choosing by end position makes the result independent of how text is split into tokens.
        """
        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        for stop in self._stop:
            start = text.find(stop)
            if start < 0:
                continue
            candidate = (start + len(stop), start, stop)
            if best is None or candidate[:2] < best[:2]:
                best = candidate
        return None if best is None else (best[1], best[2])

    def _num_chars_to_hold(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        for length in range(min(len(text), self._max_stop_len - 1), 0, -1):
            suffix = text[-length:]
            if any(stop.startswith(suffix) for stop in self._stop):
                return length
        return 0
