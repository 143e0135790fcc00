"""Qwen3-Coder / Qwen3.5 XML tool calls.

    <tool_call>
    <function=write_file>
    <parameter=path>
    src/main.py
    </parameter>
    <parameter=content>
    print("hi")
    </parameter>
    </function>
    </tool_call>

Values are bare text, so nothing needs escaping; the template wraps each in one newline on either
side, which is dropped. Values are strings unless the tool's schema declares another type.
`ToolCallStart` goes out at `<function=NAME>`; each parameter streams as one arguments delta
when it completes. A value ends at `</parameter>`, and also at `<parameter=`, `</function>` or
`</tool_call>` starting a line: models sometimes forget `</parameter>`, and a forgotten close
tag would otherwise swallow the rest of the output. Only at a line start, because values are
often code, and code may mention these tags mid-line (a value holding one of them at the start
of a line is cut there). One function per block, as the template writes it.

Qwen3-Coder models sometimes leave out the `<tool_call>` opener (Ollama's issues report it in
about one tool turn in five; vLLM's parser then reads the whole output as calls). So
`<function=NAME>` at the start of a line, outside a block, opens one too, when NAME is one of
the tools offered (without tools, or for another name, it stays text); a `</tool_call>` after
its `</function>` is read as its closer. A block whose `</function>` came but whose closer did
not when the output ended is a call, as vLLM and SGLang read it.
"""

from __future__ import annotations

import json
from typing import Any

from freetoken_agent.parsers.events import (
    ContentDelta,
    Event,
    ParseWarning,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from freetoken_agent.parsers.schema import convert_value, parameter_schemas
from freetoken_agent.parsers.tags import find_first
from freetoken_agent.parsers.tool_parser import CallNumbering, ToolCallParser

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
FUNCTION = "<function="
FUNCTION_END = "</function>"
PARAMETER = "<parameter="
PARAMETER_END = "</parameter>"
VALUE_ENDS = (PARAMETER_END, "\n" + PARAMETER, "\n" + FUNCTION_END, "\n" + CLOSE)
MAX_NAME = 256  # a longer "name" is prose, not a tag

_PRE_FUNCTION = 0
_FUNCTION_NAME = 1
_PRE_PARAMETER = 2
_PARAMETER_NAME = 3
_VALUE = 4
_POST_FUNCTION = 5
_BROKEN = 6


class Qwen3CoderParser(ToolCallParser):
    """Content text -> content deltas and Qwen3-Coder tool calls, typed by `tools` if given."""

    open_tag = OPEN

    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__()
        self._schemas = parameter_schemas(tools)
        self._names = {(t.get("function") or t).get("name") for t in tools or ()}

    def _new_reader(self, tag: str) -> _CoderCall:
        return _CoderCall(self._numbering, self._schemas, implicit=tag == FUNCTION)

    def _opening(self, buf: str) -> tuple[int, str] | None:
        """The `<tool_call>` opener, or an earlier `<function=NAME>` at a line start naming a
        tool offered (the module docstring)."""
        found = super()._opening(buf)
        end = found[0] if found else len(buf)
        j = buf.find(FUNCTION)
        while 0 <= j < end:
            if j == 0 and self._line_start or j > 0 and buf[j - 1] == "\n":
                gt = buf.find(">", j)
                if gt >= 0 and buf[j + len(FUNCTION) : gt] in self._names:
                    return j, FUNCTION
            j = buf.find(FUNCTION, j + 1)
        return found

    def _held(self, buf: str) -> int:
        """Also the last line, while it may still become `<function=NAME>` of a tool."""
        held = super()._held(buf)
        k = buf.rfind("\n") + 1
        if not self._names or (k == 0 and not self._line_start):
            return held
        line = buf[k:]
        if FUNCTION.startswith(line) or (
            line.startswith(FUNCTION)
            and ">" not in line
            and any(n.startswith(line[len(FUNCTION) :]) for n in self._names)
        ):
            return max(held, len(line))
        return held


class _CoderCall:
    """One `<tool_call>` block holding one `<function=...>`."""

    def __init__(
        self, numbering: CallNumbering, schemas: dict[str, dict[str, dict]], implicit: bool
    ) -> None:
        """`implicit`: opened by `<function=` itself (no `<tool_call>`; the body starts at the
        name, and the block may end after `</function>`)."""
        self.completed = False
        self._numbering = numbering
        self._schemas = schemas
        self._implicit = implicit
        self._opener = FUNCTION if implicit else OPEN  # the model's text before the body
        self._body = ""
        self._p = 0  # next unparsed body position
        self._state = _FUNCTION_NAME if implicit else _PRE_FUNCTION
        self._function_end = 0  # body position just after `</function>`
        self._index: int | None = None
        self._id = ""
        self._name = ""
        self._param = ""
        self._args: dict[str, Any] = {}
        self._search_from = 0  # for value terminators and, once broken, the close tag

    def feed(self, text: str, out: list[Event]) -> str | None:
        self._body += text
        while True:
            step = self._step(out)
            if step is None:
                return None  # needs more text
            if step >= 0:
                return self._body[step:]  # the block ended; step is where the rest starts

    def finish(self, out: list[Event]) -> None:
        if self._state == _POST_FUNCTION:  # whole but for its closer: a call (docstring)
            self._complete(len(self._body), out)
            return
        self._reject("unterminated tool call at end of output", self._opener + self._body, out)

    def _step(self, out: list[Event]) -> int | None:
        """One parse step. None: wait for text; -1: progressed; >= 0: ended, rest starts there."""
        state, body = self._state, self._body
        if state == _BROKEN:
            i = body.find(CLOSE, self._search_from)
            if i < 0:
                self._search_from = max(self._search_from, len(body) - len(CLOSE) + 1)
                return None
            raw = self._opener + body[:i] + CLOSE
            self._reject("tool call does not follow <function=...><parameter=...>", raw, out)
            return i + len(CLOSE)
        if state in (_FUNCTION_NAME, _PARAMETER_NAME):
            return self._read_name(out)
        if state == _VALUE:
            return self._read_value(out)
        expected = {
            _PRE_FUNCTION: (FUNCTION,),
            _PRE_PARAMETER: (PARAMETER, FUNCTION_END, CLOSE),
            _POST_FUNCTION: (CLOSE,),
        }[state]
        q = self._p
        while q < len(body) and body[q].isspace():
            q += 1
        self._p = q
        for tag in expected:
            if body.startswith(tag, q):
                self._p = q + len(tag)
                if tag == FUNCTION:
                    self._state = _FUNCTION_NAME
                elif tag == PARAMETER:
                    self._state = _PARAMETER_NAME
                elif tag == FUNCTION_END:
                    self._state = _POST_FUNCTION
                    self._function_end = self._p
                else:
                    return self._complete(q, out) + len(CLOSE)
                return -1
        if q == len(body) or any(tag.startswith(body[q:]) for tag in expected):
            return None
        if state == _POST_FUNCTION and self._implicit:  # no closer: the text goes on
            return self._complete(self._function_end, out)
        return self._break(q, out)

    def _read_name(self, out: list[Event]) -> int | None:
        body, p = self._body, self._p
        gt = body.find(">", p)
        if gt < 0:
            tail = body[p:]
            if "\n" in tail or "<" in tail or len(tail) > MAX_NAME:
                return self._break(p, out)
            return None
        # Judged on the raw text, as above while `>` has not come: judging the stripped name
        # accepted `<function=f\n>` in one chunk and broke it in several (found by fuzzing).
        raw = body[p:gt]
        name = raw.strip()
        if not name or "\n" in raw or "<" in raw or len(raw) > MAX_NAME:
            return self._break(p, out)
        self._p = gt + 1
        if self._state == _FUNCTION_NAME:
            self._index, self._id = self._numbering.next()
            self._name = name
            out.append(ToolCallStart(self._index, self._id, name))
            self._state = _PRE_PARAMETER
        else:
            self._param = name
            self._search_from = self._p
            self._state = _VALUE
        return -1

    def _read_value(self, out: list[Event]) -> int | None:
        body = self._body
        q, tag = find_first(body, VALUE_ENDS, self._search_from)
        if q < 0:
            longest = max(len(t) for t in VALUE_ENDS)
            self._search_from = max(self._search_from, len(body) - longest + 1)
            return None
        text = body[self._p : q]
        text = text[1:] if text.startswith("\n") else text
        text = text[:-1] if text.endswith("\n") else text
        schema = self._schemas.get(self._name, {}).get(self._param)
        value = convert_value(text, schema)
        lead = ", " if self._args else "{"
        self._args[self._param] = value
        fragment = f"{lead}{json.dumps(self._param, ensure_ascii=False)}: "
        fragment += json.dumps(value, ensure_ascii=False)
        out.append(ToolCallArgsDelta(self._index, fragment))  # type: ignore[arg-type]
        self._p = q + len(tag) if tag == PARAMETER_END else q
        self._state = _PRE_PARAMETER
        return -1

    def _complete(self, end: int, out: list[Event]) -> int:
        """The call ends; returns `end`, where the block's text ends."""
        assert self._index is not None
        out.append(ToolCallArgsDelta(self._index, "}" if self._args else "{}"))
        out.append(ToolCallEnd(self._index, self._id, self._name, self._args))
        self.completed = True
        return end

    def _break(self, at: int, out: list[Event]) -> int:
        if self._implicit:
            # No closer will come to end it: the opener's line up to here is text now, and
            # the rest is read again (a real block later in the output stays a call).
            message = "tool call does not follow <function=...><parameter=...>"
            self._reject(message, FUNCTION + self._body[:at], out)
            return at
        self._state = _BROKEN
        self._search_from = at
        return -1

    def _reject(self, message: str, raw: str, out: list[Event]) -> None:
        out.append(ContentDelta(raw))
        out.append(ParseWarning(message, raw, self._index))
