"""Events a streaming output parser emits, in the order the model produced them.

The parsers own these records; the Session turns them into its own events and each integration
into its wire format (LangChain chunks, OpenAI deltas, WebSocket messages). Text deltas are split
wherever the decoded chunks happened to end, so consumers concatenate them; `coalesce` merges
neighbours for consumers that want the whole text at once.
"""

from __future__ import annotations

import secrets
import string
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class ReasoningDelta:
    """Text of the model's thinking block (`<think>` ... `</think>`)."""

    text: str


@dataclass(slots=True)
class ContentDelta:
    """Answer text: everything outside reasoning and outside well-formed tool calls."""

    text: str


@dataclass(slots=True)
class ToolCallStart:
    """A tool call began; its name is known. `index` counts calls of this output from 0."""

    index: int
    id: str
    name: str


@dataclass(slots=True)
class ToolCallArgsDelta:
    """A piece of the call's arguments as JSON text.

    The deltas of one call concatenate to a JSON object equal to `ToolCallEnd.arguments`, so a UI
    or LangChain's `tool_call_chunks` can show the arguments while they are generated.
    """

    index: int
    text: str


@dataclass(slots=True)
class ToolCallEnd:
    """The call is complete and well formed; `arguments` is the parsed JSON object."""

    index: int
    id: str
    name: str
    arguments: dict[str, Any]


@dataclass(slots=True)
class ParseWarning:
    """Model text that looked like a tool call but was not one; it was re-emitted as content.

    `index` is set when a `ToolCallStart` with that index was already emitted: that call is void
    (no `ToolCallEnd` will follow) and its text is part of the content instead.
    """

    message: str
    raw_text: str
    index: int | None = None


Event = (
    ReasoningDelta | ContentDelta | ToolCallStart | ToolCallArgsDelta | ToolCallEnd | ParseWarning
)


def new_call_id() -> str:
    """A fresh tool-call id in the OpenAI style (`call_` + 24 hex digits)."""
    return "call_" + uuid.uuid4().hex[:24]


ID_ALPHABET = string.ascii_letters + string.digits
MISTRAL_ID_LENGTH = 9


def new_mistral_call_id() -> str:
    """A fresh tool-call id as Mistral's chat templates require it: 9 letters and digits
    (they raise on any other length; vLLM's Mistral ids are the same)."""
    return "".join(secrets.choice(ID_ALPHABET) for _ in range(MISTRAL_ID_LENGTH))


def coalesce(events: Iterable[Event]) -> list[Event]:
    """Merge neighbouring text deltas of one kind (and argument deltas of one call).

    Streaming splits text wherever a chunk ended; after coalescing, the same model output gives
    the same list whatever the chunking was.
    """
    merged: list[Event] = []
    for event in events:
        last = merged[-1] if merged else None
        if isinstance(event, (ReasoningDelta, ContentDelta)) and type(last) is type(event):
            merged[-1] = type(event)(last.text + event.text)  # type: ignore[union-attr]
        elif (
            isinstance(event, ToolCallArgsDelta)
            and isinstance(last, ToolCallArgsDelta)
            and last.index == event.index
        ):
            merged[-1] = ToolCallArgsDelta(event.index, last.text + event.text)
        else:
            merged.append(event)
    return merged
