"""Constrained turns: a forced tool call, JSON-schema output, or "a call or the answer's JSON".

The grammar (engine/constrained.py) starts at the first generated token, so such a turn
- renders with thinking off, and closes a think block the template left open anyway;
- ends its prompt with the tool-call opener when the model writes Hermes calls (`ForcedFormat`),
  so the model sees its usual context and the KV of the next turn lines up;
- replays to the output parser what the prompt (not the model) wrote, and closes the call
  block the grammar stops before (`PrefedParser`): the grammar writes the Hermes call body
  {"name": ..., "arguments": ...}, so a Hermes parser reads it whatever the model's own format.
Schemas are made self-contained ($refs inlined) so they can be nested, and closed
(additionalProperties false unless they say otherwise).
"""

from __future__ import annotations

import json
from typing import Any

from langchain_core.utils.json_schema import dereference_refs

from freetoken_agent.chat_format import ChatFormat, Prompt
from freetoken_agent.engine.constrained import tool_call_schema
from freetoken_agent.parsers import ContentDelta, OutputParser, ParseWarning, ToolCallEnd
from freetoken_agent.parsers.reasoning import CLOSE as THINK_CLOSE
from freetoken_agent.parsers.reasoning import prompt_opens_reasoning

HERMES_OPEN = "<tool_call>\n"
HERMES_CLOSE = "\n</tool_call>"
THINK_END = THINK_CLOSE + "\n\n"


class ForcedFormat:
    """A ChatFormat whose prompts end with what a constrained turn must start from: the think
    block closed (when the template left it open) and, for a Hermes tool call, `<tool_call>\\n`.
    One per Session: `opened` describes the last rendered prompt for its parser."""

    def __init__(self, inner: ChatFormat, opener: str) -> None:
        self.inner = inner
        self.tokenizer = inner.tokenizer
        self.opener = opener
        self.opened = False  # the inner prompt left a think block open

    def render(self, messages, tools=None, add_generation_prompt: bool = True, **kw) -> Prompt:
        prompt = self.inner.render(messages, tools, add_generation_prompt, **kw)
        self.opened = prompt_opens_reasoning(prompt.text)
        suffix = (THINK_END if self.opened else "") + self.opener
        if not suffix:
            return prompt
        ids = self.tokenizer.backend.encode(suffix, add_special_tokens=False).ids
        return Prompt(
            prompt.token_ids + list(ids),
            prompt.text + suffix,
            prompt.anchors,
            prompt.messages,
            prompt.generation_prefix + suffix,
        )


class PrefedParser:
    """An OutputParser that first reads `head` (what the prompt, not the model, wrote: the think
    closer, the call opener) and at the end `tail` (the call closer the grammar stops before),
    the tail only when the body is complete JSON: a body cut by max_tokens stays unterminated,
    and the parser says so, rather than closing it into a misleading JSON error. When the parser
    voids the call block the head opened, its content and the invalid call's text are only
    what the model wrote: the opener and the closer are not the model's."""

    def __init__(self, inner: Any, head: str, tail: str) -> None:
        self.inner = inner
        self.head = head
        self.tail = tail
        self.body: list[str] = []
        self.opener = HERMES_OPEN if head.endswith(HERMES_OPEN) else ""
        self.wrapped = bool(self.opener)  # the block the head opened has not ended yet

    def feed(self, text: str) -> list:
        head, self.head = self.head, ""
        if self.tail:
            self.body.append(text)
        return self._as_written(self.inner.feed(head + text), "")

    def finish(self) -> list:
        head, self.head = self.head, ""
        tail = self.tail if self.tail and _is_json("".join(self.body)) else ""
        closed = self._as_written(self.inner.feed(head + tail), tail)
        return closed + self._as_written(self.inner.finish(), "")

    def _as_written(self, events: list, tail: str) -> list:
        """`events` with the opener (and `tail`, when that was fed) taken out of the voided
        block's text. The parser re-emits a voided block as a ContentDelta of its raw text right
        before the ParseWarning."""
        out: list = []
        for event in events:
            if self.wrapped and isinstance(event, ToolCallEnd):
                self.wrapped = False
            elif self.wrapped and isinstance(event, ParseWarning):
                self.wrapped = False
                raw = event.raw_text.removeprefix(self.opener)
                raw = raw.removesuffix(tail) if tail else raw
                if out and out[-1] == ContentDelta(event.raw_text):
                    out.pop()
                    out += [ContentDelta(raw)] if raw else []
                event = ParseWarning(event.message, raw, event.index)
            out.append(event)
        return out


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


class JsonOrCallParser:
    """Output constrained to "the answer's JSON or a {"name", "arguments"} call of a tool" (tools
    and a response_format together, as LangChain agents bind them): only the whole text tells
    which, so content is held until the end, then read as a Hermes call body or released."""

    def __init__(self, opened: bool, tools: list[dict]) -> None:
        self.inner = OutputParser(None, opened, None)
        self.tools = tools
        self.names = {t["function"]["name"] for t in tools}
        self.held: list[str] = []

    def feed(self, text: str) -> list:
        return self._hold(self.inner.feed(text))

    def finish(self) -> list:
        out = self._hold(self.inner.finish())
        text = "".join(self.held)
        try:
            obj = json.loads(text)
        except ValueError:
            obj = None
        is_call = isinstance(obj, dict) and set(obj) == {"name", "arguments"}
        if is_call and obj["name"] in self.names:
            calls = OutputParser("hermes", False, self.tools)
            return out + calls.feed(HERMES_OPEN + text + HERMES_CLOSE) + calls.finish()
        return out + ([ContentDelta(text)] if text else [])

    def _hold(self, events: list) -> list:
        out = []
        for event in events:
            if isinstance(event, ContentDelta):
                self.held.append(event.text)
            else:
                out.append(event)
        return out


def _inline(schema: dict) -> dict:
    """`schema` with its $refs inlined, so it can sit inside a larger schema (anyOf, a call's
    arguments) where "#/$defs/..." would no longer resolve."""
    out = dereference_refs(schema)
    if "$ref" not in json.dumps(out):
        out = {k: v for k, v in out.items() if k not in ("$defs", "definitions")}
    return out


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")  # name -> schema
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties", "not", "contains", "if", "then", "else")


def _closed(schema: Any) -> Any:
    """Objects that list their properties get additionalProperties false unless they say
    otherwise (OpenAI's strict mode does the same): otherwise the grammar lets a model append
    keys nobody asked for, and a weak one rambles there until max_tokens. Walks subschemas by
    keyword, so a property that happens to be named "properties" is left alone."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _closed(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_closed(sub) for sub in out[key]]
    for key in _SCHEMA_ONE:
        if key in out:
            sub = out[key]
            out[key] = [_closed(s) for s in sub] if isinstance(sub, list) else _closed(sub)
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def output_schema(mode: str, tools: list[dict], schema: dict | None) -> dict | None:
    """The json_schema that constrains a turn of `mode` (None: unconstrained)."""
    if mode in ("auto", "none"):
        return None
    if mode == "json":
        return _closed(schema)
    calls = [tool_call_schema(_inline_tool(t)) for t in tools]
    if mode == "json_or_call":
        calls.append(_inline(schema))
    return _closed(calls[0] if len(calls) == 1 else {"anyOf": calls})


def _inline_tool(tool: dict) -> dict:
    fn = dict(tool["function"])
    fn["parameters"] = _inline(fn.get("parameters") or {"type": "object", "properties": {}})
    return {"type": "function", "function": fn}
