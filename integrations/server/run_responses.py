"""A run served as an HTTP response, whichever API asked for it: started (refusals answered
before anything is sent), then streamed as server-sent events or collected into one JSON body.

The OpenAI routes (chat and text completions) and the Anthropic Messages route serve their runs
alike, as `Choices` (choices.py: one run per choice; a message or a one-choice completion is
one): only the wire differs (error objects, the events of a stream, the whole reply), which
each API writes through a `Wire`. What they share is the runs' lifetime: they are cancelled
however the response ends (finished, failed, or a client that left), by the stream once that
has taken them over, else here. A non-streamed response watches for the client's disconnect while it
collects, so a client that gives up stops its generation at once, as a streamed one does.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from freetoken_agent.engine.outputs import EngineClosedError, InvalidRequestError
from freetoken_agent.integrations.server.bridge import TurnCancelled
from freetoken_agent.integrations.server.choices import Choices
from freetoken_agent.integrations.server.keepalive import with_keepalive

log = logging.getLogger("freetoken.server")


class Wire(Protocol):
    """How one API writes a run."""

    def refused(self, error: InvalidRequestError) -> Response:
        """The client's error (400, or the status the error carries)."""

    def failed(self, message: str, status: int = 500) -> Response:
        """A server-side failure before anything was sent (500; 503 when the engine service
        has stopped: every request would fail until the server restarts)."""

    def stream(self, choices: Choices) -> AsyncIterator[str]:
        """The SSE body of started choices: their events, their end, an error in-band."""

    def take(self, index: int, event: Any) -> None:
        """One event of choice `index` being collected (what the whole reply needs beyond
        the run's own record of it)."""

    def whole(self, choices: Choices) -> dict[str, Any] | Response:
        """The body of collected choices that ended without an engine error (or the error
        response of a run cut short, where the API has no body for it: named_stream.cut_short)."""


class TurnStreamResponse(StreamingResponse):
    """An SSE response that cancels its choices however it ends: finished, failed, or cut off
    by a client that left (also before the first chunk, when the body generator never ran).
    A silent stretch (a long prefill, a queue) sends keep-alive comments (keepalive.py)."""

    def __init__(self, choices: Choices, content: AsyncIterator[str]) -> None:
        super().__init__(
            with_keepalive(content),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.choices = choices

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.choices.cancel()


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the body was read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> asyncio.Future | None:
    """Run `work` until it ends (its task, done: read its result) or the client leaves first
    (None: `work` cancelled and ended)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})
    return None if task.cancelled() else task


async def _complete(request: Request, choices: Choices, wire: Wire) -> Response:
    async def collect() -> None:
        async for index, event in choices.events():
            wire.take(index, event)

    try:
        collected = await _unless_disconnected(request, collect())
    finally:
        choices.cancel()
    if collected is None:
        return Response(status_code=499)  # the client left; nobody reads this
    if collected.exception() is not None:
        e = collected.exception()
        log.error("run failed: %s: %s", type(e).__name__, e)
        return wire.failed(f"{type(e).__name__}: {e}")
    if choices.error is not None:  # an engine error ended a choice (the others cancelled)
        return wire.failed(choices.error)
    whole = wire.whole(choices)
    return whole if isinstance(whole, Response) else JSONResponse(whole)


async def _started(request: Request, choices: Choices) -> bool:
    """Start the choices, unless the client leaves first: a turn queued behind another turn of
    its session (X-Session-Id) waits in start() until that one ends, and a client that gave
    up meanwhile must not have its turn rendered, prefilled and run for nobody. False when
    the client left (start() cancels its runs as it stops); a refusal raises."""
    started = await _unless_disconnected(request, choices.start())
    if started is None:
        return False
    started.result()
    return True


async def serve_choices(request: Request, choices: Choices, wire: Wire, stream: bool) -> Response:
    """Start the choices (refusals: the wire's 400), then stream them or collect them; they
    are cancelled however this ends, by the stream once that has taken them over."""
    handed_over = False
    try:
        try:
            if not await _started(request, choices):
                return Response(status_code=499)  # the client left; nobody reads this
        except InvalidRequestError as e:
            return wire.refused(e)
        except TurnCancelled as e:  # by another client of its session before it started
            return wire.failed(str(e), 499)  # as a cancel mid-run is (named_stream.cut_short)
        except EngineClosedError as e:  # closed, or failed MAX_FAILURES steps: /health says so
            log.warning("refused a run: %s", e)  # once a request, no traceback: not a bug here
            return wire.failed(str(e), 503)
        except Exception as e:  # noqa: BLE001 - e.g. the grammar library is missing
            log.exception("could not start a run")
            return wire.failed(f"{type(e).__name__}: {e}")
        if stream:
            handed_over = True
            return TurnStreamResponse(choices, wire.stream(choices))
        return await _complete(request, choices, wire)
    finally:
        if not handed_over:
            choices.cancel()
