"""A transport wrapped so its connection can tell two things the SDK does not say.

Whether the server has gone: the read stream's end (EOF: a stdio server's stdout closed because
the process exited) is reported to `on_close` the moment the SDK's receive loop meets it, so a
server that exits between calls is marked broken before the next call, not found out by it.

Whether a request went out: the SDK reports a lost connection as the same CONNECTION_CLOSED
error whether the request was written before the server went away or refused because the
connection was already closed. A caller that wants to know wraps its request in `tracking()`:
the record it gets is marked once a message of the request's task reaches the transport (the
start of a write counts: it may have been delivered). Unmarked, the server never saw the call,
so sending it again on a new connection cannot do its work twice.
"""

from __future__ import annotations

import contextvars
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any

import anyio


@dataclass(slots=True)
class Attempt:
    sent: bool = False  # a message of this attempt reached the transport


# Set per request in the caller's task; the SDK writes a request from that task, while answers
# to the server's own requests (sampling) are written from its tasks, where this is unset.
_ATTEMPT: contextvars.ContextVar[Attempt | None] = contextvars.ContextVar(
    "freetoken_mcp_attempt", default=None
)


@contextmanager
def tracking() -> Iterator[Attempt]:
    """Track whether what the current task sends inside the block reaches the transport."""
    attempt = Attempt()
    token = _ATTEMPT.set(attempt)
    try:
        yield attempt
    finally:
        _ATTEMPT.reset(token)


@asynccontextmanager
async def watched(transport: Any, on_close: Callable[[], None]) -> AsyncIterator[Any]:
    """`transport` (an SDK transport: an async context manager of (read, write) streams) with
    its read stream's end reported to `on_close` and its writes marked on `tracking` records."""
    async with transport as (read, write):
        yield _Read(read, on_close), _Write(write)


class _Read:
    """The SDK's ReadStream protocol, passed through; its end calls `on_close` first."""

    def __init__(self, inner: Any, on_close: Callable[[], None]) -> None:
        self._inner = inner
        self._on_close = on_close

    def __getattr__(self, name: str) -> Any:  # `last_context` and whatever else is asked
        return getattr(self._inner, name)

    def __aiter__(self) -> _Read:
        return self

    async def __anext__(self) -> Any:
        try:
            return await self._inner.__anext__()
        except (StopAsyncIteration, anyio.EndOfStream, anyio.ClosedResourceError):
            self._on_close()
            raise

    async def receive(self) -> Any:
        try:
            return await self._inner.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            self._on_close()
            raise

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def __aenter__(self) -> _Read:
        await self._inner.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> bool | None:
        return await self._inner.__aexit__(*exc)


class _Write:
    """The SDK's WriteStream protocol, passed through; a send marks the task's Attempt."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def send(self, item: Any, /) -> None:
        attempt = _ATTEMPT.get()
        if attempt is not None:
            attempt.sent = True
        await self._inner.send(item)

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def __aenter__(self) -> _Write:
        await self._inner.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> bool | None:
        return await self._inner.__aexit__(*exc)
