"""Character-level helpers for call scanners: a matcher of fixed markup with JSON strings in
it, and the length of a text's end that may still begin a tag."""

from __future__ import annotations

_SPACE = " \t\r\n"
_HEX = "0123456789abcdefABCDEF"
STRING = object()  # the step of a pattern that reads one JSON string


class Pattern:
    """Matches characters against a fixed sequence of steps: optional whitespace, a literal or
    a JSON string. `push` says whether the text so far can still match (None), has just matched
    (True) or cannot (False). The string step's text is kept (`string`)."""

    def __init__(self, *steps: object) -> None:
        # Optional whitespace goes before every step.
        self._steps = steps
        self._step = 0
        self._pos = 0  # characters of a literal matched, or of the string read
        self._escape = 0  # string: -1 after a backslash, then \u hex digits to come
        self.string = ""

    def push(self, c: str) -> bool | None:
        step = self._steps[self._step]
        if self._pos == 0 and c in _SPACE:
            return None
        if step is STRING:
            return self._push_string(c)
        assert isinstance(step, str)
        if c != step[self._pos]:
            return False
        self._pos += 1
        return self._next() if self._pos == len(step) else None

    def _push_string(self, c: str) -> bool | None:
        if self._pos == 0:
            if c != '"':
                return False
        elif ord(c) < 0x20:
            return False
        elif self._escape == -1:  # just after a backslash
            if c not in '"\\/bfnrtu':
                return False
            self._escape = 4 if c == "u" else 0
        elif self._escape:  # one of the four hex digits of a \u escape
            if c not in _HEX:
                return False
            self._escape -= 1
        elif c == "\\":
            self._escape = -1
        elif c == '"':
            self.string += c
            return self._next()
        self.string += c
        self._pos += 1
        return None

    def _next(self) -> bool | None:
        self._step += 1
        self._pos = 0
        return True if self._step == len(self._steps) else None


def held_prefix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that a proper prefix of `tag` could continue."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0
