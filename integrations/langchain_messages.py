"""LangChain messages -> FreeToken's structured history; `tool_choice` in its LangChain forms.

LangChain agents resend the whole conversation every call, as `BaseMessage`s. The Session wants
its own records (`freetoken_agent.messages`), because the chat template renders reasoning, tool
calls and tool results from structured fields, and the KV reuse between turns depends on the
rendering being the same each time. So reasoning that came back in
`AIMessage.additional_kwargs["reasoning_content"]` (or as a v1 `reasoning` content block) goes
back in as `AssistantMessage.reasoning`, where the template puts it between its think markers.

Everything here raises `ValueError` (InvalidRequestError) naming the message index and the
problem: bad input must never reach the engine.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    ChatMessage,
    HumanMessage,
    ToolMessage,
)
from langchain_core.messages import SystemMessage as LcSystemMessage
from langchain_core.utils.function_calling import convert_to_openai_tool

from freetoken_agent.engine.outputs import InvalidRequestError
from freetoken_agent.messages import (
    AssistantMessage,
    Message,
    SystemMessage,
    ToolCall,
    ToolResult,
    UserMessage,
    in_call_order,
)

# Content blocks that are not text but are carried elsewhere on an AIMessage (tool_calls) or
# hold its reasoning; the v1 output format and Anthropic-style providers put them in content
# ("tool_use" is Anthropic's call block, mirrored in `tool_calls` by LangChain).
_CALL_BLOCKS = {"tool_call", "tool_call_chunk", "invalid_tool_call", "server_tool_call", "tool_use"}
_REASONING_BLOCKS = {"reasoning": "reasoning", "thinking": "thinking"}


def _texts(content: Any, where: str, reasoning: list[str] | None = None) -> list[str]:
    """The text parts of a LangChain content value. Reasoning blocks go to `reasoning` when it
    is given (assistant messages); any other non-text block is refused: the engine is
    text-only and silently dropping an image would change the question."""
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise InvalidRequestError(
            f"{where}: content must be a string or a list of content blocks, "
            f"got {type(content).__name__}"
        )
    out = []
    for j, block in enumerate(content):
        if isinstance(block, str):
            out.append(block)
            continue
        kind = block.get("type") if isinstance(block, Mapping) else None
        if kind == "text" and isinstance(block.get("text"), str):
            out.append(block["text"])
        elif reasoning is not None and kind in _REASONING_BLOCKS:
            reasoning.append(str(block.get(_REASONING_BLOCKS[kind]) or ""))
        elif reasoning is not None and kind in _CALL_BLOCKS:
            continue
        else:
            raise InvalidRequestError(
                f"{where}: content block {j} has type {kind!r}; this engine takes text only"
            )
    return out


def _assistant(msg: AIMessage, where: str) -> AssistantMessage:
    blocks: list[str] = []
    text = "".join(_texts(msg.content, where, blocks))
    reasoning = msg.additional_kwargs.get("reasoning_content")
    if reasoning is None and blocks:
        reasoning = "".join(blocks)
    if reasoning is not None and not isinstance(reasoning, str):
        raise InvalidRequestError(f"{where}: additional_kwargs['reasoning_content'] must be str")
    calls = []
    for j, call in enumerate(msg.tool_calls):
        if not call.get("id"):
            raise InvalidRequestError(
                f"{where}: tool call {j} ({call.get('name')}) has no id; a ToolMessage can only "
                "answer a call by its id"
            )
        calls.append(ToolCall(call["id"], call["name"], dict(call.get("args") or {})))
    # invalid_tool_calls are not rendered as calls: their text already is in the content (the
    # parser re-emits a malformed call block as content), as the model wrote it. Their ids are
    # kept: agents answer them with an error ToolMessage (create_agent does, for every one, on
    # every model call), which then renders as the tool response the model was given. A call
    # without an id cannot be answered, so it has nothing to keep.
    invalid = [c["id"] for c in msg.invalid_tool_calls if c.get("id")]
    return AssistantMessage(text, reasoning, calls, invalid)


def _convert(msg: BaseMessage, where: str) -> Message:
    if isinstance(msg, LcSystemMessage):
        return SystemMessage("\n".join(_texts(msg.content, where)))
    if isinstance(msg, HumanMessage):
        return UserMessage("\n".join(_texts(msg.content, where)))
    if isinstance(msg, AIMessage):  # AIMessageChunk too
        return _assistant(msg, where)
    if isinstance(msg, ToolMessage):
        return ToolResult(
            tool_call_id=msg.tool_call_id,
            content="\n".join(_texts(msg.content, where)),
            is_error=msg.status == "error",
            name=msg.name,
        )
    if isinstance(msg, ChatMessage):
        role = {"human": "user", "ai": "assistant", "developer": "system"}.get(msg.role, msg.role)
        if role == "system":
            return SystemMessage("\n".join(_texts(msg.content, where)))
        if role == "user":
            return UserMessage("\n".join(_texts(msg.content, where)))
        if role == "assistant":
            return AssistantMessage("".join(_texts(msg.content, where)))
        raise InvalidRequestError(f"{where}: ChatMessage role {msg.role!r} is not supported")
    raise InvalidRequestError(
        f"{where}: unsupported message type {type(msg).__name__}; expected SystemMessage, "
        "HumanMessage, AIMessage or ToolMessage"
    )


def to_history(messages: Sequence[BaseMessage]) -> list[Message]:
    """FreeToken records for a LangChain conversation, validated as a whole (every tool result
    answers an earlier call), tool results in the order of their calls (`in_call_order`)."""
    if not messages:
        raise InvalidRequestError("no messages: give at least one message")
    out = []
    for i, msg in enumerate(messages):
        where = f"message {i} ({getattr(msg, 'type', type(msg).__name__)})"
        try:
            out.append(_convert(msg, where))
        except InvalidRequestError as e:
            text = str(e)
            raise InvalidRequestError(
                text if text.startswith(where) else f"{where}: {text}"
            ) from None
    return in_call_order(out)


# ------------------------------------------------------------------------------ tool_choice


def function_tools(tools: Sequence[Any], strict: bool | None = None) -> list[dict[str, Any]]:
    """`tools` (dicts, pydantic models, functions, BaseTools) as OpenAI function tools; a
    provider's built-in tool (`{"type": "web_search_preview"}`, ...) is refused by name."""
    specs = [convert_to_openai_tool(_nested(t), strict=strict) for t in tools]
    for i, spec in enumerate(specs):
        if spec.get("type") != "function" or not isinstance(spec.get("function"), Mapping):
            raise ValueError(
                f"tool {i} ({spec.get('type')!r:.60}) is not a function tool: this engine runs "
                "no provider-built tools; give a function, a schema or a BaseTool"
            )
    return specs


def _nested(tool: Any) -> Any:
    """The Responses API's flat function tool `{"type": "function", "name", "description",
    "parameters", "strict"}` (what an OpenAI Agents SDK or Responses-API snippet gives) in the
    chat form, which LangChain's conversion reads; any other tool as it is."""
    flat = isinstance(tool, Mapping) and tool.get("type") == "function" and "function" not in tool
    if not flat or not isinstance(tool.get("name"), str):
        return tool
    keys = ("name", "description", "parameters", "strict")
    return {"type": "function", "function": {k: tool[k] for k in keys if k in tool}}


def tool_names(tools: Sequence[Mapping[str, Any]]) -> list[str]:
    return [t["function"]["name"] for t in tools]


def parse_tool_choice(choice: Any, names: Sequence[str]) -> tuple[str, tuple[str, ...]]:
    """(mode, allowed tools) for a tool_choice in any form LangChain passes on.

    mode "auto": the model decides; "none": no tool call (the tools are rendered, as the
    server renders them, so the history's KV is reused, but nothing is read as a call);
    "required": exactly one call of one of the allowed tools, forced by constrained decoding.
    Forms: None/"auto", "none"/False, "any"/"required"/True, a tool name, or a dict
    ({"type": "function", "function": {"name": ...}}, {"name": ...}, {"type": "any"}...)."""
    if isinstance(choice, Mapping):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else choice.get("name")
        choice = name if name is not None else choice.get("type")
    if choice is None or choice == "auto":
        return "auto", ()
    if choice is False or choice == "none":
        return "none", ()
    if not names:
        raise InvalidRequestError(f"tool_choice={choice!r} needs tools; none are bound")
    if choice is True or choice in ("any", "required"):
        return "required", tuple(names)
    if isinstance(choice, str) and choice in names:
        return "required", (choice,)
    raise InvalidRequestError(
        f"tool_choice {choice!r} is not 'auto', 'none', 'any'/'required' or one of the bound "
        f"tools: {', '.join(names)}"
    )
