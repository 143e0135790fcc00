"""An Anthropic history (`system`, and `messages` of content blocks) as OpenAI chat messages,
the form the chat route checks and reads (chat_request.parse_messages), so one set of checks
and one reading serve both APIs.

Blocks and what they become:
- `text`: a text content part (its `cache_control` and `citations` are dropped: the engine's
  prefix cache needs no hint, and citations are for documents, which are refused).
- `tool_use` (assistant): a tool call, its `input` written as the JSON arguments.
- `tool_result` (user): a `tool` message answering `tool_use_id` (content a string or text
  blocks; `is_error` kept on the record: the chat templates do not render it). A user message
  holding tool results and text becomes, in block order, the tool messages and a user message
  per run of text, as the template must see them: results right after the calls.
- `thinking` (assistant): the message's reasoning (its `signature` ignored: this server signs
  nothing); `redacted_thinking` is dropped (its text is encrypted for another model).
- anything else (`image`, `document`, `search_result`, server tools' blocks): refused by name.
An assistant message renders its text before its calls (the OpenAI form has no other order).
A last message of the assistant's is continued, as Anthropic continues such a prefilled reply
(anthropic_request.py asks the chat route for `continue_final_message`).

`origins` says where each OpenAI message came from ("system", "messages[2]"), so a refusal of
the shared checks, which index the OpenAI messages, can name the Anthropic one.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from freetoken_agent.integrations.server.errors import BadParam, check_nesting


@dataclass(slots=True)
class OpenAIHistory:
    messages: list[dict[str, Any]] = field(default_factory=list)
    origins: list[str] = field(default_factory=list)  # per message: the field it came from

    def add(self, message: dict[str, Any], origin: str) -> None:
        self.messages.append(message)
        self.origins.append(origin)


_CHAT_INDEX = re.compile(r"messages\[(\d+)\]")


def with_origins(text: str, origins: list[str]) -> str:
    """`text` (a refusal of the shared checks, or its param) with each `messages[i]` of the
    translated chat history named as the field it came from, `origins[i]` (an index past them
    is left as it is). The Anthropic and Responses routes' refusals name their own fields."""

    def origin(found: re.Match) -> str:
        i = int(found.group(1))
        return origins[i] if i < len(origins) else found.group(0)

    return _CHAT_INDEX.sub(origin, text)


def _blocks(content: Any, where: str) -> list[Mapping[str, Any]]:
    """`content` as a list of typed blocks (a string is one text block)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise BadParam(
            f"{where} must be a string or a list of content blocks, got {content!r:.40}", where
        )
    for j, block in enumerate(content):
        if not isinstance(block, Mapping) or not isinstance(block.get("type"), str):
            raise BadParam(
                f"{where}[{j}] must be an object with a 'type', got {block!r:.40}", where
            )
    return content


def _unsupported(kind: str, at: str, param: str) -> BadParam:
    return BadParam(f"{at}: {kind} blocks are not supported by this server", param)


def _text_part(block: Mapping[str, Any], at: str, param: str) -> dict[str, str]:
    if not isinstance(block.get("text"), str):
        raise BadParam(f"{at}.text must be a string, got {block.get('text')!r:.40}", param)
    return {"type": "text", "text": block["text"]}


def _text_parts(content: Any, where: str, param: str) -> list[dict[str, str]]:
    """Content that may hold text only (the system prompt, a tool result's content)."""
    parts = []
    for j, block in enumerate(_blocks(content, where)):
        if block["type"] != "text":
            raise _unsupported(block["type"], f"{where}[{j}]", param)
        parts.append(_text_part(block, f"{where}[{j}]", param))
    return parts


def _tool_message(block: Mapping[str, Any], at: str, param: str) -> dict[str, Any]:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise BadParam(f"{at}.tool_use_id must be the id of a tool_use block", param)
    is_error = block.get("is_error")
    if is_error is not None and not isinstance(is_error, bool):
        raise BadParam(f"{at}.is_error must be true or false, got {is_error!r:.40}", param)
    content = block.get("content")
    parts = [] if content is None else _text_parts(content, f"{at}.content", param)
    message = {"role": "tool", "tool_call_id": call_id, "content": parts}
    if is_error:
        message["is_error"] = True
    return message


def _user(content: Any, where: str, history: OpenAIHistory) -> None:
    param = where
    text: list[dict[str, str]] = []  # the run of text blocks not yet added
    for j, block in enumerate(_blocks(content, f"{where}.content")):
        at, kind = f"{where}.content[{j}]", block["type"]
        if kind == "text":
            text.append(_text_part(block, at, param))
        elif kind == "tool_result":
            if text:
                history.add({"role": "user", "content": text}, where)
                text = []
            history.add(_tool_message(block, at, param), where)
        elif kind in ("tool_use", "thinking", "redacted_thinking"):
            raise BadParam(f"{at}: {kind} blocks belong to assistant messages", param)
        else:
            raise _unsupported(kind, at, param)
    if text:
        history.add({"role": "user", "content": text}, where)


def _tool_call(block: Mapping[str, Any], at: str, param: str) -> dict[str, Any]:
    call_id, name, arguments = block.get("id"), block.get("name"), block.get("input")
    if not isinstance(call_id, str) or not call_id:
        raise BadParam(f"{at}.id must be a non-empty string", param)
    if not isinstance(name, str) or not name:
        raise BadParam(f"{at}.name must be the tool's name", param)
    if not isinstance(arguments, Mapping):
        raise BadParam(f"{at}.input must be an object, got {arguments!r:.40}", param)
    text = json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": text}}


def _assistant(content: Any, where: str, history: OpenAIHistory) -> None:
    param = where
    text: list[dict[str, str]] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(_blocks(content, f"{where}.content")):
        at, kind = f"{where}.content[{j}]", block["type"]
        if kind == "text":
            text.append(_text_part(block, at, param))
        elif kind == "tool_use":
            calls.append(_tool_call(block, at, param))
        elif kind == "thinking":
            if not isinstance(block.get("thinking"), str):
                raise BadParam(f"{at}.thinking must be a string", param)
            reasoning.append(block["thinking"])
        elif kind == "redacted_thinking":
            continue
        elif kind == "tool_result":
            raise BadParam(f"{at}: tool_result blocks belong to user messages", param)
        else:
            raise _unsupported(kind, at, param)
    message: dict[str, Any] = {"role": "assistant", "content": text or ""}
    if reasoning:
        message["reasoning_content"] = "\n".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    history.add(message, where)


def openai_history(system: Any, messages: Any) -> OpenAIHistory:
    """The OpenAI messages of an Anthropic `system` and `messages`, with their origins."""
    history = OpenAIHistory()
    if system is not None:
        parts = _text_parts(system, "system", "system")
        if any(p["text"] for p in parts):  # an empty system prompt is none (no empty block)
            history.add({"role": "system", "content": parts}, "system")
    if not isinstance(messages, list) or not messages:
        raise BadParam("messages must be a non-empty list of messages", "messages")
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise BadParam(f"{where} must be an object with a role and content", where)
        # Before anything walks it (json.dumps of a tool_use's input recurses per level).
        check_nesting(message, where)
        role, content = message.get("role"), message.get("content")
        if content is None or content == [] or content == "":
            raise BadParam(f"{where}.content must not be empty", where)
        if role == "user":
            _user(content, where, history)
        elif role == "assistant":
            _assistant(content, where, history)
        else:
            raise BadParam(
                f"{where}.role must be 'user' or 'assistant', got {role!r:.40} (the system "
                "prompt goes in `system`)",
                where,
            )
    return history
