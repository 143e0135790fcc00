"""Reply: a turn's parser events gathered into the assistant message they make up.

Both wire formats need it: a non-streamed completion returns it, and a WebSocket session
appends it to the history it keeps for clients that send only their new messages. A call the
parser voided (a ParseWarning with its index: the block was not a well-formed call after all)
is dropped; its text arrives as content.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from freetoken_agent.engine.outputs import TokenLogprob
from freetoken_agent.messages import AssistantMessage, ToolCall
from freetoken_agent.parsers import (
    ContentDelta,
    ParseWarning,
    ReasoningDelta,
    ToolCallEnd,
    ToolCallStart,
)


@dataclass(slots=True)
class Reply:
    reasoning: list[str] = field(default_factory=list)
    content: list[str] = field(default_factory=list)
    calls: dict[int, ToolCallEnd] = field(default_factory=dict)  # by index, complete calls
    started: dict[int, ToolCallStart] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    # Every generated token's log-probabilities, in order, when the turn asked for them (the
    # Session's TokenLogprob events); they belong to the tokens, not to any one part.
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def add(self, event: Any) -> None:
        if isinstance(event, TokenLogprob):
            self.logprobs.append(event)
        elif isinstance(event, ReasoningDelta):
            self.reasoning.append(event.text)
        elif isinstance(event, ContentDelta):
            self.content.append(event.text)
        elif isinstance(event, ToolCallStart):
            self.started[event.index] = event
        elif isinstance(event, ToolCallEnd):
            self.calls[event.index] = event
        elif isinstance(event, ParseWarning):
            self.warnings.append(event.message)
            if event.index is not None:
                self.started.pop(event.index, None)
                self.calls.pop(event.index, None)

    @property
    def text(self) -> str:
        return "".join(self.content)

    @property
    def reasoning_text(self) -> str | None:
        return "".join(self.reasoning) if self.reasoning else None

    def tool_calls(self) -> list[ToolCall]:
        return [ToolCall(c.id, c.name, dict(c.arguments)) for _, c in sorted(self.calls.items())]

    def message(self) -> AssistantMessage:
        return AssistantMessage(self.text, self.reasoning_text, self.tool_calls())

    def openai_message(self) -> dict[str, Any]:
        """The `message` of a chat.completion choice."""
        calls = self.tool_calls()
        out: dict[str, Any] = {"role": "assistant", "content": self.text or (None if calls else "")}
        if self.reasoning_text is not None:
            out["reasoning_content"] = self.reasoning_text
        if calls:
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {
                        "name": c.name,
                        "arguments": json.dumps(c.arguments, ensure_ascii=False),
                    },
                }
                for c in calls
            ]
        return out
