"""Anthropic message objects from a TurnRun's events: a stream's named events, or one whole
message. Both come from one `MessageFormat`, fed the same events in the same order, so a
streamed reply, reassembled as Anthropic's SDKs do, is the whole one.

Content blocks are opened in the order their kinds come: reasoning makes a `thinking` block,
content a `text` block, each tool call a `tool_use` block; consecutive pieces of one kind fill
one block, and a block closes when another kind starts. Blocks are numbered 0, 1, 2... as
they open. A thinking block's `signature` is empty: this server signs nothing, and clients
send the block back as they got it (anthropic_messages.py ignores the signature).

A tool call goes out whole, at its ToolCallEnd: `content_block_start` with the tool_use (empty
input), one `input_json_delta` with all of its JSON, `content_block_stop`. Its pieces are not
streamed, for the reason completion_format.py gives: the parser may still void the block, and
an event cannot be taken back.

Usage, as Anthropic counts it: `input_tokens` are the prompt tokens computed for this request,
`cache_read_input_tokens` those reused from the prefix cache (the sum is the prompt, which is
what count_tokens answers: clients add the three input fields to know how full the context
is), `cache_creation_input_tokens` 0 (caching costs nothing extra here). A stream's
message_start knows only the prompt's length, so it counts it all as input; message_delta
gives the final split.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from freetoken_agent.integrations.server.anthropic_errors import anthropic_error_body
from freetoken_agent.integrations.server.named_stream import Event, cut_short
from freetoken_agent.parsers import ContentDelta, ReasoningDelta, ToolCallEnd
from freetoken_agent.session import Usage


def stop_reason(
    finish_reason: str | None, usage: Usage | None, max_tokens: int | None = None
) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a run's finish reason (TurnRun.finish_reason: "stop",
    "length", "tool_calls") and its Usage (the stop string that ended it, if one did). A
    "length" short of the request's `max_tokens` is the context's end:
    "model_context_window_exceeded", as Anthropic says it (Claude Code would otherwise advise
    raising its output-token cap, which cannot help)."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        short = usage is not None and max_tokens is not None
        if short and usage.completion_tokens < max_tokens:
            return "model_context_window_exceeded", None
        return "max_tokens", None
    stop_string = usage.stop_string if usage is not None else None
    if stop_string is not None:
        return "stop_sequence", stop_string
    return "end_turn", None


def usage_json(usage: Usage | None, prompt_tokens: int = 0) -> dict[str, int]:
    """Anthropic's usage; without a Usage (not ended yet), `prompt_tokens` all as input."""
    if usage is None:
        return {
            "input_tokens": prompt_tokens,
            "output_tokens": 0,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        }
    return {
        "input_tokens": usage.prompt_tokens - usage.reused_tokens,
        "output_tokens": usage.completion_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": usage.reused_tokens,
    }


class MessageFormat:
    def __init__(self, model: str, max_tokens: int | None = None) -> None:
        """`max_tokens`: the request's, to tell its end from the context's (`stop_reason`)."""
        self.model = model
        self.max_tokens = max_tokens
        self.id = "msg_" + uuid.uuid4().hex
        self.blocks: list[dict[str, Any]] = []  # the content so far, in order
        self._open: str | None = None  # the kind of the last block while it is open

    def _message(
        self, content: list, usage: dict, reason: str | None, sequence: str | None
    ) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": usage,
        }

    def start(self, prompt_tokens: int) -> Event:
        return "message_start", {
            "type": "message_start",
            "message": self._message([], usage_json(None, prompt_tokens), None, None),
        }

    def _close(self) -> list[Event]:
        if self._open is None:
            return []
        self._open = None
        return [
            ("content_block_stop", {"type": "content_block_stop", "index": len(self.blocks) - 1})
        ]

    def _open_block(self, block: dict[str, Any]) -> list[Event]:
        """Close the open block, open `block`."""
        events = self._close()
        self.blocks.append(block)
        self._open = block["type"]
        start = {"type": "content_block_start", "index": len(self.blocks) - 1}
        events.append(("content_block_start", {**start, "content_block": dict(block)}))
        return events

    def _delta(self, delta: dict[str, Any]) -> Event:
        index = len(self.blocks) - 1
        return "content_block_delta", {
            "type": "content_block_delta",
            "index": index,
            "delta": delta,
        }

    def _text(self, kind: str, text: str) -> list[Event]:
        """A piece of a thinking or text block (whose text field is named as the kind)."""
        events = []
        if self._open != kind:
            empty = {"type": kind, kind: ""} | ({"signature": ""} if kind == "thinking" else {})
            events = self._open_block(empty)
        self.blocks[-1][kind] += text
        events.append(self._delta({"type": f"{kind}_delta", kind: text}))
        return events

    def add(self, event: Any) -> list[Event]:
        """The stream events of one of the run's events (the content is kept either way)."""
        if isinstance(event, ReasoningDelta) and event.text:
            return self._text("thinking", event.text)
        if isinstance(event, ContentDelta) and event.text:
            return self._text("text", event.text)
        if isinstance(event, ToolCallEnd):
            call = {"type": "tool_use", "id": event.id, "name": event.name, "input": {}}
            events = self._open_block(call)
            self.blocks[-1]["input"] = dict(event.arguments)
            arguments = json.dumps(event.arguments, ensure_ascii=False)
            events.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))
            return events + self._close()
        return []  # ToolCallStart, ToolCallArgsDelta (held: see above), warnings, logprobs

    def end(self, finish_reason: str | None, usage: Usage | None) -> list[Event]:
        """A stream's last events: the open block's stop, message_delta, message_stop; for a
        run cut short (a cancel by another client of its session, the engine's close), which
        Anthropic has no stop_reason for, an `error` event naming why."""
        why = cut_short(usage)
        if why is not None:
            return self.failed(why)
        reason, sequence = stop_reason(finish_reason, usage, self.max_tokens)
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        return [
            *self._close(),
            (
                "message_delta",
                {"type": "message_delta", "delta": delta, "usage": usage_json(usage)},
            ),
            ("message_stop", {"type": "message_stop"}),
        ]

    def failed(self, message: str) -> list[Event]:
        """A failure after the stream began: an `error` event, which ends it."""
        return [("error", anthropic_error_body(message, "api_error"))]

    def message(self, finish_reason: str | None, usage: Usage | None) -> dict[str, Any]:
        """The whole message."""
        reason, sequence = stop_reason(finish_reason, usage, self.max_tokens)
        return self._message(self.blocks, usage_json(usage), reason, sequence)
