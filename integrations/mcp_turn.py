"""The records of an MCPHost run, and how one model turn becomes an assistant message.

`StepStart`, `ToolExecuted` and `RunResult` are the host's own events (beside the parsers'
events and the Session's `Usage`). `Turn` gathers a turn's events; a forced turn (tool_choice)
is generated without the tool-call parser, as bare `{"name", "arguments"}` JSON under a grammar,
and parsed here. `openai_tool` and `call_schema` turn MCP tools into what the prompt and the
grammar need; `cap_result` cuts a tool result to what one result may put into the history.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import mcp_types as types

from freetoken_agent.integrations.constrained_output import call_part, named_properties
from freetoken_agent.messages import AssistantMessage, Message, ToolCall, ToolResult
from freetoken_agent.parsers import (
    ContentDelta,
    ParseWarning,
    ReasoningDelta,
    ToolCallEnd,
    new_call_id,
)
from freetoken_agent.session import Usage


@dataclass(slots=True)
class StepStart:
    """A model turn begins; `forced` names the tool_choice it runs under, if any."""

    step: int
    forced: str | None = None


@dataclass(slots=True)
class ToolExecuted:
    """A tool call has run (or failed); `result` is what the model will read."""

    call: ToolCall
    server: str | None  # None when the name matched no tool
    result: ToolResult
    seconds: float


@dataclass(slots=True)
class RunResult:
    """The end of a run: the last event of `stream`, the value of `run`."""

    messages: list[Message]  # the history given, plus every turn and tool result of the run
    answer: str  # the last assistant turn's visible text
    steps: int  # model turns taken
    stop_reason: str  # answer | max_steps | error
    usage: list[Usage] = field(default_factory=list)
    error: str | None = None


class Turn:
    """What one model turn produced, gathered from its events."""

    def __init__(self) -> None:
        self.contents: list[str] = []
        self.reasoning: list[str] = []
        self.calls: list[ToolCall] = []
        self.raw: list[str] = []  # a forced turn's JSON text
        self.void: str | None = None  # why a forced turn's call is void, when it is
        self.usage = Usage(0, 0, 0, 0, "error", "the turn produced no usage")

    @property
    def content(self) -> str:
        return "".join(self.contents)

    def take(self, event: Any) -> None:
        if isinstance(event, ContentDelta):
            self.contents.append(event.text)
        elif isinstance(event, ReasoningDelta):
            self.reasoning.append(event.text)
        elif isinstance(event, ToolCallEnd):
            self.calls.append(ToolCall(event.id, event.name, dict(event.arguments)))

    def forced_call(self) -> list[Any]:
        """Parse a forced turn's JSON into its call; content plus a warning if it is cut."""
        text = "".join(self.raw)
        try:
            data = json.loads(text)
            call = ToolCall(new_call_id(), data["name"], dict(data["arguments"]))
        except (ValueError, KeyError, TypeError) as e:
            self.contents.append(text)
            reason = self.usage.finish_reason
            why = (
                f"max_tokens ({self.usage.completion_tokens}) cut it: raise max_tokens"
                if reason == "length"
                else f"{type(e).__name__}: {e}"
            )
            self.void = f"the forced tool call is void: {why}"
            return [ContentDelta(text), ParseWarning(self.void, text)]
        self.calls.append(call)
        return [ToolCallEnd(0, call.id, call.name, call.arguments)]

    def message(self) -> AssistantMessage:
        reasoning = "".join(self.reasoning) if self.reasoning else None
        return AssistantMessage(self.content, reasoning, list(self.calls))


def call_schema(
    tool: dict[str, Any], pinned: Mapping[str, Any], defs: dict[str, Any], prefix: str = ""
) -> dict[str, Any]:
    """The grammar of a forced call of `tool`. Unknown argument names are closed off (a weak
    model would otherwise invent keys until max_tokens) unless the tool's schema opens them;
    `pinned` arguments are fixed to their values with `const`. The input schema's $defs (what
    FastMCP writes for a pydantic parameter) go to `defs`, renamed with `prefix`, for the root
    of the schema the call sits in (constrained_output.rooted): nested under "arguments",
    their "#/$defs/..." refs would resolve nowhere and the grammar fail to compile."""
    schema = call_part(tool, prefix, defs)
    arguments = dict(schema["properties"]["arguments"])
    properties = dict(arguments.get("properties") or {})
    # Closing is forced_schema's (constrained_output.closed): it leaves an object combined
    # with allOf/anyOf/oneOf open, whose branches name the keys (closed here, they forbade
    # every key their branches require).
    # None: an open object (extra names allowed, or a $ref read elsewhere): any name goes
    named = None if "$ref" in arguments else named_properties(arguments)
    unknown = [] if named is None else sorted(set(pinned) - named)
    if unknown:
        name = tool["function"]["name"]
        raise ValueError(f"tool_choice pins argument(s) {unknown} that {name!r} does not take")
    for key, value in pinned.items():
        properties[key] = {"const": value}
    arguments["properties"] = properties
    arguments["required"] = list(dict.fromkeys([*(arguments.get("required") or []), *pinned]))
    schema["properties"] = {**schema["properties"], "arguments": arguments}
    return schema


def openai_tool(name: str, tool: types.Tool) -> dict[str, Any]:
    """An MCP tool as the OpenAI function dict chat templates render."""
    schema = dict(tool.input_schema or {})
    schema.setdefault("type", "object")
    schema.setdefault("properties", {})
    description = tool.description or tool.title or ""
    fn = {"name": name, "description": description, "parameters": schema}
    return {"type": "function", "function": fn}


def cap_result(text: str, limit: int, encode: Callable[[str], list[int]]) -> str:
    """`text` cut to `limit` tokens, the cut marked so the model knows it read a part."""
    # No token is 32 characters long in practice: encoding that much bounds the cost of a huge
    # result and still tells whether it fits.
    head = text[: limit * 32]
    n = len(encode(head))
    if n <= limit and len(head) == len(text):
        return text
    keep = len(head) * limit // max(n, limit)
    while keep and len(encode(head[:keep])) > limit:
        keep = keep * 9 // 10
    return (
        f"{text[:keep]}\n[... {len(text) - keep} characters cut: the host passes at most "
        f"{limit} tokens of a tool result]"
    )
