"""The WebSocket session stream's events, as JSON objects (one `type` each).

start        {"turn", "prompt_tokens", "user"}: the request is in the engine; `user` is the
             text of the history's last user message when the turn answers one
reasoning    {"text"}: thinking, in order
content      {"text"}: answer text, in order
tool_call    {"phase": "start", "index", "id", "name"}
             {"phase": "arguments", "index", "text"}: JSON text, concatenating to the args
             {"phase": "end", "index", "id", "name", "arguments": {...}}
tool_result  {"tool_call_id", "name", "content", "is_error"}: a tool result this turn sent
warning      {"message", "index"}: text that looked like a call but was not one
logprob      {"token_id", "token", "logprob", "bytes", "top_logprobs"}: one generated token's
             log-probabilities (the chat API's entry), when the turn's sampling asked for
             them ("logprobs": true, "top_logprobs": k); each comes before the events its
             token's text makes, thinking and tool-call tokens included
usage        {"prompt_tokens", "completion_tokens", "reused_tokens", "prefilled_tokens",
              "finish_reason", "exact", "reasoning_tokens", "first_divergence", "anchor"}:
             `reasoning_tokens` counts the think block's tokens of completion_tokens (null
             for a model without think tokens), as the chat API's usage; `first_divergence`
             counts the tokens this prompt shares with what the session last sent, and
             `anchor` ({"offset", "kind", "message_index", ...} or null) is the deepest
             semantic anchor at or before it: the nearest boundary before the edit. A
             hybrid's recurrent layers resume there or later, from a deeper checkpoint in
             the shared prefix (the last turn's end, say): `reused_tokens` says where
memory       the engine's memory split (stats()["memory"]) and its expert placement
error        {"message", "param", "code"?}
done         {"turn", "finish_reason", "message"}: the assistant message, OpenAI form
session      {"id", "turns", "running", "history"}: sent to a socket when it joins
"""

from __future__ import annotations

from typing import Any

from freetoken_agent.engine.outputs import TokenLogprob
from freetoken_agent.integrations.openai_logprobs import TokenStrings, chat_entry
from freetoken_agent.messages import ToolResult, content_text
from freetoken_agent.parsers import (
    ContentDelta,
    ParseWarning,
    ReasoningDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from freetoken_agent.session import Usage


def event_json(event: Any) -> dict[str, Any] | None:
    """A Session event (parser event or Usage) as a stream event; None for unknown kinds."""
    if isinstance(event, ReasoningDelta):
        return {"type": "reasoning", "text": event.text}
    if isinstance(event, ContentDelta):
        return {"type": "content", "text": event.text}
    if isinstance(event, ToolCallStart):
        return {
            "type": "tool_call",
            "phase": "start",
            "index": event.index,
            "id": event.id,
            "name": event.name,
        }
    if isinstance(event, ToolCallArgsDelta):
        return {"type": "tool_call", "phase": "arguments", "index": event.index, "text": event.text}
    if isinstance(event, ToolCallEnd):
        return {
            "type": "tool_call",
            "phase": "end",
            "index": event.index,
            "id": event.id,
            "name": event.name,
            "arguments": event.arguments,
        }
    if isinstance(event, ParseWarning):
        return {"type": "warning", "message": event.message, "index": event.index}
    if isinstance(event, Usage):
        return {
            "type": "usage",
            "prompt_tokens": event.prompt_tokens,
            "completion_tokens": event.completion_tokens,
            "reused_tokens": event.reused_tokens,
            "prefilled_tokens": event.prefilled_tokens,
            "finish_reason": event.finish_reason,
            "exact": event.exact,
            "reasoning_tokens": event.reasoning_tokens,
        }
    return None


def logprob_json(entry: TokenLogprob, strings: TokenStrings) -> dict[str, Any]:
    """A token's `logprob` event: its id and the chat API's entry for it."""
    return {"type": "logprob", "token_id": entry.token_id, **chat_entry(entry, strings)}


def tool_result_json(result: ToolResult) -> dict[str, Any]:
    return {
        "type": "tool_result",
        "tool_call_id": result.tool_call_id,
        "name": result.name,
        "content": content_text(result.content, "tool result"),
        "is_error": result.is_error,
    }


def memory_json(stats: dict[str, Any]) -> dict[str, Any]:
    return {"type": "memory", **stats.get("memory", {}), "experts": stats.get("experts", {})}


def error_json(message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    event = {"type": "error", "message": message, "param": param}
    if code is not None:  # only where one applies (invalid_json, model_not_found, ...)
        event["code"] = code
    return event
