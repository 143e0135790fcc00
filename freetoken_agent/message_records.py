"""The message records, one per message kind (SystemMessage, UserMessage, AssistantMessage,
ToolResult) and the ToolCall an assistant message holds, each a `@dataclass(slots=True)` that
checks its own fields when built, with the checks of content and text they share.

messages.py re-exports them beside what concerns a whole history (its validation, the order of
tool results, the conversions); its docstring shows the fields.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from freetoken_agent.engine.outputs import InvalidRequestError
from freetoken_agent.parsers.json_scan import LONE_SURROGATE

Content = str | list[dict[str, Any]]


def _check_text(text: str, where: str, what: str) -> None:
    # A Python str may hold a lone UTF-16 surrogate (JSON's "\ud83d" decodes to one). It is no
    # Unicode text: the tokenizer fails on it with an unrelated TypeError, so refuse it here.
    if (m := LONE_SURROGATE.search(text)) is not None:
        raise InvalidRequestError(
            f"{where}: {what} holds a lone UTF-16 surrogate {m.group()!r} at character {m.start()}"
        )


def _check_json_texts(value: Any, where: str, what: str) -> None:
    """_check_text on every string (keys too) of JSON-like data; iterative, as arguments built
    in code may nest deeper than the recursion limit, and each container visited once (cycles)."""
    stack, seen = [value], set()
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            _check_text(item, where, what)
        elif isinstance(item, Mapping | list | tuple) and id(item) not in seen:
            seen.add(id(item))
            stack += [*item, *item.values()] if isinstance(item, Mapping) else item


def _check_content(content: Any, where: str) -> None:
    if isinstance(content, str):
        _check_text(content, where, "content")
        return
    if not isinstance(content, list):
        raise InvalidRequestError(
            f"{where}: content must be a string or a list of content parts, "
            f"got {type(content).__name__}"
        )
    for j, part in enumerate(content):
        if not isinstance(part, Mapping) or not isinstance(part.get("type"), str):
            raise InvalidRequestError(
                f"{where}: content part {j} must be a dict with a 'type' key, got {part!r:.80}"
            )
        if part["type"] == "text":
            if not isinstance(part.get("text"), str):
                raise InvalidRequestError(f"{where}: text content part {j} has no string 'text'")
            _check_text(part["text"], where, f"text content part {j}")


@dataclass(slots=True)
class ToolCall:
    """One function call the assistant asked for. `id` pairs it with its ToolResult."""

    id: str
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.check("tool call")

    def check(self, where: str) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise InvalidRequestError(f"{where}: id must be a non-empty string, got {self.id!r}")
        if not isinstance(self.name, str) or not self.name:
            raise InvalidRequestError(
                f"{where} {self.id!r}: name must be a non-empty string, got {self.name!r}"
            )
        if not isinstance(self.arguments, dict):
            raise InvalidRequestError(
                f"{where} {self.id!r} ({self.name}): arguments must be a dict, got "
                f"{type(self.arguments).__name__} (parse JSON strings first: "
                "messages_from_openai does)"
            )
        bad = [k for k in self.arguments if not isinstance(k, str)]
        if bad:
            raise InvalidRequestError(
                f"{where} {self.id!r} ({self.name}): argument names must be strings, got {bad[0]!r}"
            )
        _check_text(self.id, where, "id")
        _check_text(self.name, where, "name")
        _check_json_texts(
            self.arguments, f"{where} {self.id!r} ({self.name})", "an argument string"
        )


@dataclass(slots=True)
class SystemMessage:
    content: Content
    role: ClassVar[str] = "system"

    def __post_init__(self) -> None:
        self.check("system message")

    def check(self, where: str) -> None:
        _check_content(self.content, where)


@dataclass(slots=True)
class UserMessage:
    content: Content
    role: ClassVar[str] = "user"

    def __post_init__(self) -> None:
        self.check("user message")

    def check(self, where: str) -> None:
        _check_content(self.content, where)


@dataclass(slots=True)
class AssistantMessage:
    """A model turn: optional reasoning (the thinking text, without its <think> markers),
    visible content and any tool calls, in the order templates render them.

    `invalid_call_ids`: the ids given to calls the model wrote but that could not be parsed
    (LangChain's `invalid_tool_calls`). They are not rendered as calls: the parser leaves such a
    block in `content`, as the model wrote it, which is where the model should see it again.
    Their ids are kept so that a ToolResult may answer one (agents tell the model its call
    failed: langchain's create_agent does so for every one); that result renders as a tool
    response like any other, before the results of the parsed calls, since templates render
    content (where the broken block is) before the calls. No answer is needed."""

    content: Content = ""
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    invalid_call_ids: list[str] = field(default_factory=list)
    role: ClassVar[str] = "assistant"

    def __post_init__(self) -> None:
        if self.content is None:  # APIs send content=None beside tool calls
            self.content = ""
        if isinstance(self.tool_calls, tuple):
            self.tool_calls = list(self.tool_calls)
        if isinstance(self.invalid_call_ids, tuple):
            self.invalid_call_ids = list(self.invalid_call_ids)
        self.check("assistant message")

    def check(self, where: str) -> None:
        _check_content(self.content, where)
        if self.reasoning is not None and not isinstance(self.reasoning, str):
            raise InvalidRequestError(
                f"{where}: reasoning must be a string or None, got {type(self.reasoning).__name__}"
            )
        if self.reasoning is not None:
            _check_text(self.reasoning, where, "reasoning")
        if not isinstance(self.tool_calls, list):
            raise InvalidRequestError(f"{where}: tool_calls must be a list of ToolCall")
        ids = set()
        for j, call in enumerate(self.tool_calls):
            if not isinstance(call, ToolCall):
                raise InvalidRequestError(
                    f"{where}: tool call {j} must be a ToolCall, got {type(call).__name__}"
                )
            call.check(f"{where}: tool call {j}")
            if call.id in ids:
                raise InvalidRequestError(f"{where}: tool call id {call.id!r} appears twice")
            ids.add(call.id)
        if not isinstance(self.invalid_call_ids, list):
            raise InvalidRequestError(f"{where}: invalid_call_ids must be a list of strings")
        for j, cid in enumerate(self.invalid_call_ids):
            if not isinstance(cid, str) or not cid:
                raise InvalidRequestError(
                    f"{where}: invalid call id {j} must be a non-empty string, got {cid!r:.40}"
                )
            _check_text(cid, where, f"invalid call id {j}")
            if cid in ids:
                raise InvalidRequestError(f"{where}: tool call id {cid!r} appears twice")
            ids.add(cid)


@dataclass(slots=True)
class ToolResult:
    """What a tool returned for the call `tool_call_id`. `is_error` marks a failed call; chat
    templates have no field for it, so the content itself must say what went wrong."""

    tool_call_id: str
    content: Content
    is_error: bool = False
    name: str | None = None
    role: ClassVar[str] = "tool"

    def __post_init__(self) -> None:
        self.check("tool result")

    def check(self, where: str) -> None:
        if not isinstance(self.tool_call_id, str) or not self.tool_call_id:
            raise InvalidRequestError(
                f"{where}: tool_call_id must be a non-empty string, got {self.tool_call_id!r}"
            )
        _check_text(self.tool_call_id, where, "tool_call_id")
        _check_content(self.content, where)
        if not isinstance(self.is_error, bool):
            raise InvalidRequestError(
                f"{where}: is_error must be a bool, got {self.is_error!r:.40}"
            )
        if self.name is not None and not isinstance(self.name, str):
            raise InvalidRequestError(f"{where}: name must be a string or None")
        if self.name is not None:
            _check_text(self.name, where, "name")


Message = SystemMessage | UserMessage | AssistantMessage | ToolResult
MESSAGE_TYPES = (SystemMessage, UserMessage, AssistantMessage, ToolResult)
