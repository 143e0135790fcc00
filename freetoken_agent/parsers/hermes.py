"""Hermes-style tool calls (Hermes 2/3, Qwen2.5, Qwen3, Qwen3-Next, OLMoE by instruction).

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The JSON is scanned as it arrives: `ToolCallStart` goes out as soon as the name string is
complete and the `"arguments"` object streams verbatim from there, so its deltas concatenate to
the model's own JSON text. The call only counts once `</tool_call>` closes a body (or the
output ends after it, `finish`) that is strict JSON (`loads_strict`: no NaN or Infinity,
nesting capped) naming its arguments key once; otherwise the block is re-emitted as content
with a ParseWarning (carrying the index when a start had already gone out). A `</tool_call>`
inside a JSON string is data; but a raw newline is never valid inside one, even after a
backslash, so a newline-preceded close tag always closes.
"""

from __future__ import annotations

import json

from freetoken_agent.parsers.call_object import ARGS_KEYS, call_from_object
from freetoken_agent.parsers.events import (
    ContentDelta,
    Event,
    ParseWarning,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from freetoken_agent.parsers.json_scan import JsonScanner, loads_strict
from freetoken_agent.parsers.tool_parser import CallNumbering, ToolCallParser

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


class HermesParser(ToolCallParser):
    """Content text -> content deltas and Hermes tool calls."""

    open_tag = OPEN

    def _new_reader(self, tag: str) -> _HermesCall:
        return _HermesCall(self._numbering)


class _HermesCall:
    """One `<tool_call>` block: a JSON object with a name and an arguments object."""

    def __init__(self, numbering: CallNumbering) -> None:
        self.completed = False
        self._numbering = numbering
        self._body = ""
        self._scan = JsonScanner()
        self._search_from = 0  # textual search for the close tag once the scan has stopped
        self._index: int | None = None
        self._id = ""
        self._name = ""
        self._args_key = ""
        self._args_sent = -1  # body position up to which arguments were streamed

    def feed(self, text: str, out: list[Event]) -> str | None:
        self._body += text
        close = self._find_close()
        self._stream(out)
        if close < 0:
            return None
        self._finalize(close, out)
        return self._body[close + len(CLOSE) :]

    def finish(self, out: list[Event]) -> None:
        # A whole JSON body and nothing after it but whitespace (or the start of the close
        # tag): the output ended, or a stop string took `</tool_call>` off, before the closer.
        # A call, as vLLM's and SGLang's Hermes parsers read `<tool_call>(.*)` to the end.
        scan, body = self._scan, self._body
        if scan.done and not scan.broken:
            rest = body[scan.end :].strip()
            if not rest or CLOSE.startswith(rest):
                self._stream(out)
                self._finalize(scan.end, out, raw=OPEN + body)
                return
        self._reject("unterminated tool call at end of output", OPEN + body, out)

    def _find_close(self) -> int:
        """Position of the closing tag in the body, or -1 while it has not arrived."""
        body, scan = self._body, self._scan
        while not (scan.broken or scan.done):
            scan.scan(body, stop="<")
            if scan.broken or scan.done:
                self._search_from = scan.break_pos if scan.broken else scan.end
                break
            p = scan.pos
            if p >= len(body):
                return -1
            if body.startswith(CLOSE, p):
                return p
            if CLOSE.startswith(body[p:]):
                return -1  # maybe the close tag, cut by the chunk boundary
            scan.mark_broken()  # `<` outside a string is not JSON
            self._search_from = p
        i = body.find(CLOSE, self._search_from)
        if i < 0:
            self._search_from = max(self._search_from, len(body) - len(CLOSE) + 1)
        return i

    def _stream(self, out: list[Event]) -> None:
        """Emit the start once the name is known, then the arguments text scanned so far."""
        # Decided on the scan's state alone (frozen once broken; member spans never move), so
        # every chunking of the same text streams the same start and the same argument text.
        scan, body = self._scan, self._body
        if self._index is None:
            span = scan.members.get("name")
            if span is None or span[1] < 0 or body[span[0]] != '"':
                return
            try:
                name = json.loads(body[span[0] : span[1]])
            except ValueError:
                return
            if not name:
                return
            self._index, self._id = self._numbering.next()
            self._name = name
            out.append(ToolCallStart(self._index, self._id, name))
        if not self._args_key:
            for key, span in scan.members.items():
                if key in ARGS_KEYS:
                    if body[span[0]] == "{":  # a JSON string holding JSON is decoded at the end
                        self._args_key, self._args_sent = key, span[0]
                    break
            if not self._args_key:
                return
        span = scan.members[self._args_key]  # the first value written; a repeat is rejected
        limit = span[1] if span[1] >= 0 else scan.pos
        if limit > self._args_sent:
            out.append(ToolCallArgsDelta(self._index, body[self._args_sent : limit]))
            self._args_sent = limit

    def _finalize(self, close: int, out: list[Event], raw: str | None = None) -> None:
        """The block's body ends at `close`; `raw`: its text, if not OPEN + body + CLOSE."""
        body = self._body[:close]
        raw = raw if raw is not None else OPEN + body + CLOSE
        try:
            call = call_from_object(loads_strict(body))
        except ValueError as exc:
            call = f"tool call is not valid JSON: {exc}"
        if isinstance(call, str):
            self._reject(call, raw, out)
            return
        name, key, args = call
        if self._index is not None and name != self._name:
            self._reject("tool call names its function twice", raw, out)
            return
        if key in self._scan.repeated or (self._args_key and self._args_key != key):
            # json.loads keeps the last of a repeated key, the stream showed the first. This was
            # decided on spans that moved with the chunking (found by fuzzing); now it is always
            # a rejection, on spans that never move.
            self._reject("tool call repeats its arguments", raw, out)
            return
        if self._index is None:
            self._index, self._id = self._numbering.next()
            out.append(ToolCallStart(self._index, self._id, name))
        if self._args_key:
            span = self._scan.members[self._args_key]
            if span[1] > self._args_sent:
                out.append(ToolCallArgsDelta(self._index, self._body[self._args_sent : span[1]]))
        else:
            out.append(ToolCallArgsDelta(self._index, json.dumps(args, ensure_ascii=False)))
        out.append(ToolCallEnd(self._index, self._id, name, args))
        self.completed = True

    def _reject(self, message: str, raw: str, out: list[Event]) -> None:
        out.append(ContentDelta(raw))
        out.append(ParseWarning(message, raw, self._index))
