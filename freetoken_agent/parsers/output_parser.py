"""The whole output of one generation: reasoning first, then content with tool calls."""

from __future__ import annotations

from freetoken_agent.parsers.events import ContentDelta, Event
from freetoken_agent.parsers.reasoning import ReasoningSplitter
from freetoken_agent.parsers.registry import make_tool_parser
from freetoken_agent.parsers.tool_parser import ToolCallParser


class OutputParser:
    """Decoded text, in any chunks, -> reasoning, content and tool-call events.

    Reasoning is split off first, so a tool call written while thinking stays reasoning.
    `tool_format` None: no tool calls, all non-reasoning text is content. One parser per
    generation; it never raises on model text (malformed calls become content + ParseWarning).
    """

    def __init__(
        self,
        tool_format: str | None = None,
        starts_in_reasoning: bool = False,
        tools: list[dict] | None = None,
    ) -> None:
        self._reasoning = ReasoningSplitter(starts_in_reasoning)
        self._tools: ToolCallParser | None = (
            make_tool_parser(tool_format, tools) if tool_format else None
        )
        self._finished = False

    def feed(self, text: str) -> list[Event]:
        """Consume the next decoded chunk; return the events it completes."""
        if self._finished:
            raise RuntimeError("feed() after finish()")
        return self._route(self._reasoning.feed(text))

    def finish(self) -> list[Event]:
        """The generation ended: release held-back text and close what is open."""
        if self._finished:
            return []
        self._finished = True
        out = self._route(self._reasoning.finish())
        if self._tools is not None:
            out += self._tools.finish()
        return out

    def _route(self, events: list) -> list[Event]:
        if self._tools is None:
            return events
        out: list[Event] = []
        for event in events:
            if isinstance(event, ContentDelta):
                out += self._tools.feed(event.text)
            else:
                out.append(event)
        return out
