"""Mistral / Mixtral tool calls, in both of Mistral's forms.

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]   (v3 tokenizer)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}                               (v11 and later)

The list form is read whole: its calls are emitted when the list closes, all or none, because a
list that turns out malformed would otherwise void calls already ended. In the newer form the
name comes first, so `ToolCallStart` goes out at `[ARGS]` and the arguments object streams
verbatim. An optional `[CALL_ID]id` before `[ARGS]` is skipped (ids are ours: 9 letters and
digits, as Mistral's templates require of the calls sent back). There is no close
tag: a call ends where its JSON ends, so JSON that breaks (say, a raw newline inside a string)
leaves the block open until the output ends, when it becomes content with a ParseWarning.
`[TOOL_CALLS]` must survive detokenization although it is a special token in v3 tokenizers:
the engine keeps the special tokens that are parser tags (engine/text/markers.py).
"""

from __future__ import annotations

import json
import re
from typing import Any

from freetoken_agent.parsers.call_object import call_from_object
from freetoken_agent.parsers.events import (
    ContentDelta,
    Event,
    ParseWarning,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    new_mistral_call_id,
)
from freetoken_agent.parsers.json_scan import JsonScanner, loads_strict
from freetoken_agent.parsers.tool_parser import CallNumbering, ToolCallParser

OPEN = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
NAME = re.compile(r"[\w.\-:/]*")
_ID = re.compile(r"[A-Za-z0-9_\-]*")
MAX_NAME = 256  # a longer "name" is prose, not a call

_PRE = 0  # after [TOOL_CALLS]: a JSON list/object or a name follows
_LIST = 1
_FN_NAME = 2
_FN_ID = 3
_ARGS = 4
_BROKEN = 5  # the JSON cannot be valid and has no end; wait for the output's end


class MistralParser(ToolCallParser):
    """Content text -> content deltas and Mistral tool calls."""

    open_tag = OPEN
    make_call_id = staticmethod(new_mistral_call_id)  # what the templates take back

    def _new_reader(self, tag: str) -> _MistralCalls:
        return _MistralCalls(self._numbering)


class _MistralCalls:
    """What follows one `[TOOL_CALLS]`: a list of calls, or one named call."""

    def __init__(self, numbering: CallNumbering) -> None:
        self.completed = False
        self._numbering = numbering
        self._body = ""
        self._p = 0
        self._state = _PRE
        self._scan: JsonScanner | None = None
        self._name = ""
        self._index: int | None = None
        self._id = ""
        self._sent = 0  # body position up to which arguments were streamed

    def feed(self, text: str, out: list[Event]) -> str | None:
        self._body += text
        while True:
            step = self._step(out)
            if step is None:
                return None
            if step >= 0:
                return self._body[step:]

    def finish(self, out: list[Event]) -> None:
        why = "malformed" if self._state == _BROKEN else "unterminated"
        self._reject(f"{why} tool call at end of output", len(self._body), out)

    def _step(self, out: list[Event]) -> int | None:
        """None: wait for text; -1: progressed; >= 0: the block ended, the rest starts there."""
        body, p, state = self._body, self._p, self._state
        if state == _BROKEN:
            return None
        if state in (_PRE, _ARGS):
            while p < len(body) and body[p].isspace():
                p += 1
            self._p = p
            if p == len(body):
                return None
            if state == _PRE:
                self._state = _LIST if body[p] in "[{" else _FN_NAME
                if self._state == _LIST:
                    self._scan = JsonScanner(p)
                return -1
            if body[p] != "{":
                return self._reject("tool call arguments are not a JSON object", p, out)
            self._scan, self._sent = JsonScanner(p), p
            self._state = _LIST  # scanned like the list form, but streamed
            return -1
        if state in (_FN_NAME, _FN_ID):
            return self._read_name(out)
        assert self._scan is not None
        self._scan.scan(body)
        if self._index is not None and self._scan.pos > self._sent:
            out.append(ToolCallArgsDelta(self._index, body[self._sent : self._scan.pos]))
            self._sent = self._scan.pos
        if self._scan.broken:
            self._state = _BROKEN
            return None
        if not self._scan.done:
            return None
        if self._index is None:
            return self._emit_list(out)
        return self._end_named(out)

    def _read_name(self, out: list[Event]) -> int | None:
        body, p = self._body, self._p
        q = (NAME if self._state == _FN_NAME else _ID).match(body, p).end()
        if q - p > MAX_NAME:
            # Cut at a fixed length: cutting at q, the end of the text so far, made the raw text
            # depend on where the chunks ended (found by fuzzing).
            return self._reject("tool call name is too long", p + MAX_NAME + 1, out)
        if q == len(body):
            return None
        for tag in (ARGS, CALL_ID):
            if body.startswith(tag, q):
                if self._state == _FN_NAME:
                    self._name = body[p:q]
                    if not self._name:
                        return self._reject("tool call has no name", q, out)
                if tag == CALL_ID and self._state == _FN_NAME:
                    self._p, self._state = q + len(CALL_ID), _FN_ID
                    return -1
                if tag == ARGS:
                    self._index, self._id = self._numbering.next()
                    out.append(ToolCallStart(self._index, self._id, self._name))
                    self._p, self._state = q + len(ARGS), _ARGS
                    return -1
            if tag.startswith(body[q:]):
                return None
        return self._reject("[TOOL_CALLS] is not followed by a call", q, out)

    def _end_named(self, out: list[Event]) -> int:
        assert self._scan is not None and self._index is not None
        start, end = self._p, self._scan.end  # _p: where the arguments object begins
        try:
            args = loads_strict(self._body[start:end])
        except ValueError as exc:
            return self._reject(f"tool call arguments are not valid JSON: {exc}", end, out)
        if not isinstance(args, dict):
            return self._reject("tool call arguments are not a JSON object", end, out)
        out.append(ToolCallEnd(self._index, self._id, self._name, args))
        self.completed = True
        return end

    def _emit_list(self, out: list[Event]) -> int:
        assert self._scan is not None
        end = self._scan.end
        try:
            value = loads_strict(self._body[self._p : end])
        except ValueError as exc:
            return self._reject(f"tool call list is not valid JSON: {exc}", end, out)
        items = value if isinstance(value, list) else [value]
        calls: list[tuple[str, dict[str, Any]]] = []
        for item in items:
            call = call_from_object(item)
            if isinstance(call, str):
                return self._reject(call, end, out)
            calls.append((call[0], call[2]))
        if not calls:
            return self._reject("tool call list is empty", end, out)
        for name, args in calls:
            index, call_id = self._numbering.next()
            out.append(ToolCallStart(index, call_id, name))
            out.append(ToolCallArgsDelta(index, json.dumps(args, ensure_ascii=False)))
            out.append(ToolCallEnd(index, call_id, name, args))
        self.completed = True
        return end

    def _reject(self, message: str, upto: int, out: list[Event]) -> int:
        """Re-emit `[TOOL_CALLS]` and the body up to `upto` as content; the rest is text."""
        raw = OPEN + self._body[:upto]
        out.append(ContentDelta(raw))
        out.append(ParseWarning(message, raw, self._index))
        self._state = _BROKEN
        return upto
