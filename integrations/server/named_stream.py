"""The named server-sent events of one run, as the Anthropic and Responses APIs stream them
(`event: NAME` then `data: {...}`), through a format that turns the run's events into them:
its opening events, each parser event's, then its end, or its failure's events (after which
the stream ends: nothing more is sent for a failed run)."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any, Protocol

from freetoken_agent.integrations.server.choices import Choices
from freetoken_agent.session import Usage

log = logging.getLogger("freetoken.server")

Event = tuple[str, dict[str, Any]]  # (SSE event name, its data)

CANCELLED = (
    "the turn was cancelled before it ended: a client of its session (X-Session-Id) sent cancel"
)


def cut_short(usage: Usage | None) -> str | None:
    """Why a run ended with "abort" although its own client stayed (a client that leaves reads
    nothing): the engine's error (it was closed), else a cancel sent by another client of its
    session. None for any other end. The chat routes say "abort" as vLLM does; the Anthropic
    and Responses APIs have no such finish and say it their own way."""
    if usage is None or usage.finish_reason != "abort":
        return None
    return usage.error or CANCELLED


class EventFormat(Protocol):
    def add(self, event: Any) -> list[Event]:
        """The events of one parser event."""

    def end(self, finish_reason: str | None, usage: Usage | None) -> list[Event]:
        """The events that end a run that ended well."""

    def failed(self, message: str) -> list[Event]:
        """The events that end a run that failed (an engine error, a broken stream)."""


def named_sse(name: str, data: dict[str, Any]) -> str:
    """One server-sent event with a name."""
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


async def named_events(
    choices: Choices, fmt: EventFormat, opening: list[Event]
) -> AsyncIterator[str]:
    """The named events of `choices`' one run (neither API has `n`) through `fmt`."""
    (run,) = choices.runs
    for name, data in opening:
        yield named_sse(name, data)
    usage: Usage | None = None
    try:
        async for _, event in choices.events():
            if isinstance(event, Usage):
                usage = event
                continue
            for name, data in fmt.add(event):
                yield named_sse(name, data)
    except Exception as e:  # noqa: BLE001 - the stream has started: report in-band
        log.exception("run failed while streaming")
        ending = fmt.failed(f"{type(e).__name__}: {e}")
    else:
        if usage is not None and usage.finish_reason == "error":
            ending = fmt.failed(usage.error or "the engine failed this request")
        else:
            ending = fmt.end(run.finish_reason(), usage)
    for name, data in ending:
        yield named_sse(name, data)
