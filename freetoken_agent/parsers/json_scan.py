"""Incremental structural scan of one JSON object or array inside a growing string.

Streaming tool calls needs three facts long before the JSON is complete: whether a position is
inside a string (a closing tag there is data, not markup), where the top-level value ends, and
where each member of a top-level object starts and ends (to stream `"arguments"` as it arrives).
The scan is linear over the whole text however it is chunked. It accepts every valid JSON text
(its top level must be an object or array); it flags some invalid ones as `broken` and lets
`loads_strict` judge the rest once the value is complete.
"""

from __future__ import annotations

import json
import math
import re
import sys
from typing import Any

# A surrogate code point left in a decoded str is unpaired (json.loads joins escaped pairs):
# the engine's pattern, which refuses such text in a prompt too.
from freetoken_agent.engine.prompt_input import LONE_SURROGATE

# Inside a string only these characters matter; everything else is skipped in one search.
_STRING_STOP = re.compile(r'["\\\x00-\x1f]')
_ESCAPES = '"\\/bfnrtu'  # what may follow a backslash in a JSON string
_SPACE = " \t\n\r"
MAX_DEPTH = 100  # deeper than any tool's arguments, far within Python's recursion limit


def loads_strict(text: str) -> Any:
    """`json.loads` that raises ValueError for whatever is not plain JSON a tool can take.

    Python's decoder also takes NaN and Infinity: not JSON, so the arguments could not be sent
    on as JSON, and `nan != nan` breaks "the argument deltas parse to the arguments". A number
    past a float's range (1e999: JSON sets no limit, and a grammar-constrained call's exponent
    is free, which a weak model fills with digits) is read as the largest float of its sign,
    not inf: the call stands, its arguments still JSON. (The one place where a call's
    streamed argument text, "1e999", and its arguments differ: any JSON reader makes that
    text inf, which no JSON can carry on.) Nesting is capped at MAX_DEPTH: past
    Python's recursion limit the decoder raises RecursionError, which a parser must never let
    out (a model can loop on `[`), and where that limit falls depends on the caller's stack, so
    without a cap the same text was a call in one place and not in another. (Found by
    tests/.../parsers/test_fuzz.py.) Strings
    (keys too) holding a lone UTF-16 surrogate are refused: JSON's escapes can write one
    ("\\ud83d"), but it is no Unicode text, so it cannot be encoded as UTF-8 and the tokenizer
    fails on the history holding it.
    """
    try:
        value = json.loads(text, parse_constant=_not_json, parse_float=_float_in_range)
    except RecursionError as exc:
        raise ValueError("JSON nested too deeply") from exc
    stack = [(value, 1)]  # depth-first, without recursion
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            if (m := LONE_SURROGATE.search(item)) is not None:
                raise ValueError(f"JSON string holds a lone surrogate {m.group()!r}")
        elif isinstance(item, (dict, list)):
            if depth > MAX_DEPTH:
                raise ValueError(f"JSON nested deeper than {MAX_DEPTH}")
            children = [*item, *item.values()] if isinstance(item, dict) else item
            stack += [(child, depth + 1) for child in children]
    return value


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _float_in_range(text: str) -> float:
    value = float(text)
    if math.isinf(value):  # past the range: the nearest float
        return math.copysign(sys.float_info.max, value)
    return value


# Member states of the top-level object (depth 1).
_KEY = 0  # expecting a key (after `{` or `,`)
_IN_KEY = 1  # inside the key string
_COLON = 2  # expecting `:`
_VALUE = 3  # expecting a value
_IN_VALUE = 4  # inside a value
_COMMA = 5  # expecting `,` or `}`


class JsonScanner:
    """Scans `text[pos:]` of a string that only ever grows; resumes where it stopped."""

    __slots__ = (
        "pos",
        "in_string",
        "broken",
        "break_pos",
        "done",
        "end",
        "members",
        "repeated",
        "_value",
        "_stack",
        "_escape",
        "_string_start",
        "_state",
        "_key_start",
        "_key",
        "_primitive",
    )

    def __init__(self, start: int = 0) -> None:
        self.pos = start  # next character to scan
        self.in_string = False
        self.broken = False  # the text cannot be valid JSON; scanning stopped
        self.break_pos = -1  # where validity was lost (the start of a bad string)
        self.done = False  # the top-level value closed at `end`
        self.end = -1
        # top-level object member -> [value start, value end or -1 while open], first occurrence
        # only: a span, once seen, never moves, so decisions made on it do not depend on where
        # the chunks ended. Keys written again are in `repeated` (json.loads keeps the last).
        self.members: dict[str, list[int]] = {}
        self.repeated: set[str] = set()
        self._value: list[int] = [-1, -1]  # the span of the member value being scanned
        self._stack: list[str] = []
        self._escape = False
        self._string_start = -1
        self._state = _KEY
        self._key_start = -1
        self._key = ""
        self._primitive = False  # the open depth-1 value is a number/literal

    @property
    def depth(self) -> int:
        return len(self._stack)

    def mark_broken(self, at: int | None = None) -> None:
        """Stop: the text is known to be invalid at `at` (default: the current position)."""
        self.broken = True
        self.break_pos = self.pos if at is None else at

    def scan(self, text: str, stop: str = "") -> None:
        """Advance through `text` until its end, the value's end, a break, or (outside a
        string) a character in `stop`, which is left unscanned for the caller to inspect."""
        n = len(text)
        p = self.pos
        while p < n and not self.done and not self.broken:
            if self.in_string:
                if self._escape:
                    self._escape = False
                    if text[p] not in _ESCAPES:
                        # Not JSON; above all a backslash must not hide a raw newline, which
                        # would keep a newline-preceded close tag inside the string (fuzzing).
                        self.pos = p
                        self.mark_broken(self._string_start)
                        return
                    p += 1
                    continue
                m = _STRING_STOP.search(text, p)
                if m is None:
                    p = n
                    break
                q = m.start()
                c = text[q]
                if c == "\\":
                    self._escape = True
                    p = q + 1
                elif c == '"':
                    self.in_string = False
                    p = q + 1
                    self._string_closed(text, q)
                else:  # a raw control character: JSON strings cannot hold one
                    self.pos = q
                    self.mark_broken(self._string_start)
                    return
                continue
            c = text[p]
            if c in stop:
                break
            self.pos = p
            self._structural(c, p)
            p += 1
        if not self.broken:
            self.pos = p

    def _structural(self, c: str, p: int) -> None:
        """One character outside any string, at position p."""
        stack = self._stack
        top_object = len(stack) == 1 and stack[0] == "{"
        if top_object and self._primitive and (c in _SPACE or c in ",}"):
            self._end_value(p)
        if c in _SPACE:
            return
        if not stack:
            if c in "{[":
                stack.append(c)
                self._state = _KEY
            else:  # the top level must be an object or an array
                self.mark_broken(p)
            return
        if top_object:
            self._member_char(c, p)
            return
        if c in "{[":
            stack.append(c)
        elif c in "}]":
            self._close(c, p)
        elif c == '"':
            self._open_string(p)

    def _member_char(self, c: str, p: int) -> None:
        """A character at depth 1 of the top-level object: follow the member grammar."""
        state = self._state
        if state == _KEY and c == '"':
            self._open_string(p)
            self._key_start = p
            self._state = _IN_KEY
        elif state == _COLON and c == ":":
            self._state = _VALUE
        elif state == _VALUE and c not in ",:}]":
            self._value = [p, -1]
            if self._key in self.members:
                self.repeated.add(self._key)
            else:
                self.members[self._key] = self._value
            self._state = _IN_VALUE
            if c == '"':
                self._open_string(p)
            elif c in "{[":
                self._stack.append(c)
            else:
                self._primitive = True
        elif state == _IN_VALUE and self._primitive and c not in '"{[:]':
            pass  # more of a number or literal
        elif state in (_COMMA, _KEY) and c == "}":
            self._close(c, p)
        elif state == _COMMA and c == ",":
            self._state = _KEY
        else:
            self.mark_broken(p)

    def _open_string(self, p: int) -> None:
        self.in_string = True
        self._string_start = p

    def _string_closed(self, text: str, q: int) -> None:
        """The string opened at `_string_start` closed at q."""
        if len(self._stack) != 1 or self._stack[0] != "{":
            return
        if self._state == _IN_KEY:
            try:
                self._key = json.loads(text[self._key_start : q + 1])
            except ValueError:
                self.pos = q
                self.mark_broken(self._key_start)
                return
            self._state = _COLON
        elif self._state == _IN_VALUE:
            self._end_value(q + 1)

    def _end_value(self, end: int) -> None:
        self._value[1] = end
        self._primitive = False
        self._state = _COMMA

    def _close(self, c: str, p: int) -> None:
        stack = self._stack
        if (c == "}") != (stack[-1] == "{"):
            self.mark_broken(p)
            return
        stack.pop()
        if not stack:
            self.done = True
            self.end = p + 1
        elif len(stack) == 1 and stack[0] == "{" and self._state == _IN_VALUE:
            self._end_value(p + 1)
