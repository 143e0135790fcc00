"""A run written as a Responses API response: its output items, the events of a stream, and the
whole response object, from the parser's events (ReasoningDelta, ContentDelta, ToolCallEnd).

Output items, in the order the model wrote them:
- `reasoning` {id "rs_...", summary [], content [{type: "reasoning_text", text}]}: the think
  block, as vLLM writes an open model's reasoning (no summary: nothing summarises it); with
  include ["reasoning.encrypted_content"] its text in `encrypted_content` too (unencrypted,
  marked as this server's: responses_input.SEALED), which Codex sends back;
- `message` {id "msg_...", role "assistant", content [{type: "output_text", text,
  annotations [], logprobs []}]}: the text; when the request asked (include
  "message.output_text.logprobs", or top_logprobs), `logprobs` holds the chat route's entries
  ({token, logprob, bytes, top_logprobs}, openai_logprobs.py) of the tokens that went out with
  the message's text, each delta event the entries of its own text: the tokens the chat route
  sends with its content chunks. Tokens that made no message text (the reasoning, a call, an
  EOS after the last text) have no place in a message and are not reported; the marker that
  closes the reasoning (`</think>`, which no parser event reports) goes with the first text;
- `function_call` {id "fc_...", call_id, name, arguments}: each call, whole (its arguments are
  held until the call ends, as the Anthropic wire holds them: the parser may still void it).

A stream's events carry `sequence_number` from 0: response.created, response.in_progress, then
per item output_item.added; for text and reasoning content_part.added, their deltas
(response.output_text.delta / response.reasoning_text.delta), their .done, content_part.done;
for a call response.function_call_arguments.delta and .done; output_item.done; last
response.completed, or response.incomplete (max_output_tokens reached: status "incomplete",
incomplete_details.reason "max_output_tokens"), or response.failed on an engine error.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from freetoken_agent.engine.outputs import TokenLogprob
from freetoken_agent.integrations.openai_logprobs import Pending, TokenStrings, chat_entry
from freetoken_agent.integrations.server.named_stream import Event, cut_short
from freetoken_agent.integrations.server.responses_input import SEALED
from freetoken_agent.parsers import ContentDelta, ReasoningDelta, ToolCallEnd
from freetoken_agent.session import Usage

# Request fields the response object echoes, with their defaults when the request left them out.
_ECHOED = {
    "instructions": None,
    "max_output_tokens": None,
    "metadata": {},
    "parallel_tool_calls": True,
    "temperature": 1.0,
    "text": {"format": {"type": "text"}},
    "tool_choice": "auto",
    "tools": [],
    "top_p": 1.0,
    "user": None,
}
_PARTS = {"message": "output_text", "reasoning": "reasoning_text"}  # an item's content part


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage_json(usage: Usage | None, prompt_tokens: int = 0) -> dict[str, Any]:
    """The Responses API's usage; without a Usage (not ended yet), `prompt_tokens` as input."""
    given = usage is not None
    inputs = usage.prompt_tokens if given else prompt_tokens
    outputs = usage.completion_tokens if given else 0
    return {
        "input_tokens": inputs,
        # Nothing is written to a cache a client pays for (the SDK's type requires the field).
        "input_tokens_details": {
            "cached_tokens": usage.reused_tokens if given else 0,
            "cache_write_tokens": 0,
        },
        "output_tokens": outputs,
        "output_tokens_details": {
            "reasoning_tokens": (usage.reasoning_tokens or 0) if given else 0
        },
        "total_tokens": inputs + outputs,
    }


class ResponseFormat:
    def __init__(
        self,
        model: str,
        body: Mapping[str, Any],
        keep: Callable[[dict[str, Any]], None] | None = None,
        strings: TokenStrings | None = None,
    ) -> None:
        """`body`: the request as sent (the response echoes its settings); `keep(response)`:
        called with the response object once it ends well (the route stores it, to be read
        back or continued with previous_response_id), unless the request said store false;
        `strings`: the token strings of a request that asked for logprobs (None: not)."""
        self._strings = strings
        self._pending = Pending()  # tokens' entries since the last text went out
        self.keep = keep if body.get("store") is not False else None
        self.model = model
        self.body = body
        self.id = _new_id("resp")
        self.created_at = int(time.time())
        self.output: list[dict[str, Any]] = []  # the items so far, in order
        # include ["reasoning.encrypted_content"] (Codex, store false): the reasoning's text
        # travels there too, for a client that sends reasoning back in that field alone.
        include = body.get("include")
        self._seal = isinstance(include, list) and "reasoning.encrypted_content" in include
        self._open: str | None = None  # the kind of the last item while it is open
        self._sequence = 0

    def response(
        self, status: str, usage: dict[str, Any] | None, error: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """The response object as it stands."""
        # null is the default too (tools, tool_choice and parallel_tool_calls are not nullable)
        echoed = {k: default if self.body.get(k) is None else self.body[k]
                  for k, default in _ECHOED.items()}  # fmt: skip
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": error,
            "incomplete_details": incomplete,
            "model": self.model,
            "output": [_copy(item) for item in self.output],
            "previous_response_id": self.body.get("previous_response_id"),
            "reasoning": {"effort": None, "summary": None, **(self.body.get("reasoning") or {})},
            "store": self.keep is not None and status != "cancelled",  # (see _kept)
            "truncation": "disabled",
            "usage": usage,
            **echoed,
        }

    def _event(self, kind: str, **data: Any) -> Event:
        event = {"type": kind, "sequence_number": self._sequence, **data}
        self._sequence += 1
        return kind, event

    def start(self) -> list[Event]:
        opening = self.response("in_progress", None)
        return [
            self._event("response.created", response=opening),
            self._event("response.in_progress", response=opening),
        ]

    def add(self, event: Any) -> list[Event]:
        """The stream events of one parser event (the item is kept for the whole response)."""
        if isinstance(event, TokenLogprob):
            if self._strings is not None:
                self._pending.add(event)
            return []
        if isinstance(event, ReasoningDelta) and event.text:
            return self._text("reasoning", event.text)
        if isinstance(event, ContentDelta) and event.text:
            return self._text("message", event.text)
        if isinstance(event, ToolCallEnd):
            self._pending.take()  # the call's tokens: no message holds them
            arguments = json.dumps(event.arguments, ensure_ascii=False)
            call = {"type": "function_call", "id": _new_id("fc"), "call_id": event.id,
                    "name": event.name, "arguments": "", "status": "in_progress"}  # fmt: skip
            events = self._open_item(call)
            where = {"item_id": call["id"], "output_index": len(self.output) - 1}
            events.append(self._event("response.function_call_arguments.delta", **where,
                                      delta=arguments))  # fmt: skip
            call["arguments"] = arguments
            events.append(self._event("response.function_call_arguments.done", **where,
                                      name=event.name, arguments=arguments))  # fmt: skip
            return events + self._close()
        return []  # ToolCallStart, ToolCallArgsDelta (held: see above), warnings

    def _open_item(self, item: dict[str, Any]) -> list[Event]:
        """Close the open item, open `item`."""
        events = self._close()
        self.output.append(item)
        self._open = item["type"]
        added = {"output_index": len(self.output) - 1, "item": _copy(item)}
        return [*events, self._event("response.output_item.added", **added)]

    def _where(self) -> dict[str, Any]:
        index = len(self.output) - 1
        return {"item_id": self.output[index]["id"], "output_index": index, "content_index": 0}

    def _text(self, kind: str, text: str) -> list[Event]:
        """A piece of a reasoning or message item (its one content part)."""
        events = []
        part = _PARTS[kind]
        if self._open != kind:
            item = {"type": kind, "id": _new_id("rs" if kind == "reasoning" else "msg")}
            item |= {"summary": []} if kind == "reasoning" else {"role": "assistant"}
            item |= {"status": "in_progress", "content": []}
            events = self._open_item(item)
            empty = _empty_part(part)
            item["content"].append(empty)
            events.append(
                self._event("response.content_part.added", **self._where(), part=_part(empty))
            )
        content = self.output[-1]["content"][0]
        content["text"] += text
        # The tokens since the last text went out with this text (the reasoning's: dropped).
        taken = self._pending.take()
        extra = {}
        if kind == "message":
            extra["logprobs"] = [chat_entry(e, self._strings) for e in taken]
            content["logprobs"] += extra["logprobs"]  # (every copy that leaves copies it)
        events.append(self._event(f"response.{part}.delta", **self._where(), delta=text, **extra))
        return events

    def _close(self, status: str = "completed") -> list[Event]:
        """The open item's last events: its text's and part's .done, then output_item.done;
        `status` "incomplete" for an item the run's end cut (max_output_tokens, a failure)."""
        if self._open is None:
            return []
        kind, self._open = self._open, None
        item = self.output[-1]
        events = []
        if kind in _PARTS:
            part = item["content"][0]
            where = self._where()
            extra = {"logprobs": part["logprobs"]} if kind == "message" else {}
            events.append(
                self._event(f"response.{_PARTS[kind]}.done", **where, text=part["text"], **extra)
            )
            events.append(self._event("response.content_part.done", **where, part=_part(part)))
        item["status"] = status
        if kind == "reasoning" and self._seal:
            item["encrypted_content"] = SEALED + item["content"][0]["text"]
        done = {"output_index": len(self.output) - 1, "item": _copy(item)}
        return [*events, self._event("response.output_item.done", **done)]

    def end(self, finish_reason: str | None, usage: Usage | None) -> list[Event]:
        """A stream's last events: the open item's end, then response.completed (or
        .incomplete when max_output_tokens ended it, or a cancel: status "cancelled"; a run
        the engine's close cut short fails)."""
        if cut_short(usage) is not None and usage.error:
            return self.failed(usage.error)
        status, item_status = _ending(finish_reason)
        events = self._close(item_status)
        whole = self.response(status, usage_json(usage))
        self._kept(whole)
        name = "completed" if status == "completed" else "incomplete"  # (no cancelled event)
        return [*events, self._event(f"response.{name}", response=whole)]

    def _kept(self, whole: dict[str, Any]) -> None:
        """Store a response that ended (a cancelled one did not: nothing to continue)."""
        if self.keep is not None and whole["status"] != "cancelled":
            # a copy: the stream's event holds `whole` too
            self.keep({**whole, "output": [_copy(item) for item in whole["output"]]})

    def failed(self, message: str) -> list[Event]:
        """An engine error after the stream began: response.failed, its error the message."""
        events = self._close("incomplete")
        error = {"code": "server_error", "message": message}
        failed = self.response("failed", None, error)
        return [*events, self._event("response.failed", response=failed)]

    def whole(self, finish_reason: str | None, usage: Usage | None) -> dict[str, Any]:
        """The whole response (the items taken by `add`); a run the engine's close cut short
        is the wire's failure, not this."""
        status, item_status = _ending(finish_reason)
        self._close(item_status)
        whole = self.response(status, usage_json(usage))
        self._kept(whole)
        return whole


def _ending(finish_reason: str | None) -> tuple[str, str]:
    """(the response's status, its open item's) for a run's finish reason: max_output_tokens
    makes both incomplete; a cancel (another client of the session) cancels the response (an
    item has no cancelled status: incomplete)."""
    if finish_reason == "length":
        return "incomplete", "incomplete"
    if finish_reason == "abort":
        return "cancelled", "incomplete"
    return "completed", "completed"


def _empty_part(kind: str) -> dict[str, Any]:
    if kind == "output_text":
        return {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    return {"type": kind, "text": ""}


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    """An item as it stands (its content parts copied: the item goes on growing)."""
    out = dict(item)
    if "content" in out:
        out["content"] = [_part(part) for part in out["content"]]
    return out


def _part(part: dict[str, Any]) -> dict[str, Any]:
    """A content part as it stands (its logprobs list goes on growing)."""
    out = dict(part)
    if "logprobs" in out:
        out["logprobs"] = list(out["logprobs"])
    return out
