"""The engine seen from asyncio: a Session's synchronous turn read on the event loop.

`Session.send` is a plain generator that blocks on the engine between tokens. The MCP host runs
on an asyncio loop that must stay free while the model generates: the stdio pipes of every
server are pumped there, and a server may call back (sampling) in the middle of a tool call.
So each turn runs in a worker thread of its own and hands its events to the loop. The engine
underneath is an `EngineService` (one stepping thread, thread-safe streams), so a turn and a
sampling request may run at the same time. Cancelling the reader (or breaking out of it) closes
the generator in its thread, which aborts the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, TypeVar

from freetoken_agent.service import EngineService, shared_service

T = TypeVar("T")
_DONE: Any = object()


def as_service(engine: Any) -> tuple[EngineService, bool]:
    """The engine's one service (`shared_service`: made here when a bare Engine has none yet)
    and whether the caller holds it (and must release it)."""
    if isinstance(engine, EngineService):
        return engine, False
    if not hasattr(engine, "step") or not hasattr(engine, "tokenizer"):
        raise TypeError(
            f"engine must be a freetoken Engine or EngineService, got {type(engine).__name__}"
        )
    return shared_service(engine)


async def iterate_in_thread(make: Callable[[], Iterator[T]]) -> AsyncIterator[T]:
    """Items of the iterator `make()` (built and advanced in a fresh daemon thread), read on
    the running loop. Closing this async iterator stops the thread at its next item and closes
    the sync iterator there."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[Any, BaseException | None]] = asyncio.Queue()
    stop = threading.Event()

    def put(item: Any, error: BaseException | None = None) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody is reading
            loop.call_soon_threadsafe(queue.put_nowait, (item, error))

    def work() -> None:
        iterator = None
        try:
            iterator = make()
            for item in iterator:
                if stop.is_set():
                    break
                put(item)
        except BaseException as e:  # noqa: BLE001 - handed to the reader, raised there
            put(_DONE, e)
            return
        finally:
            close = getattr(iterator, "close", None)
            if close is not None:
                close()  # a Session turn aborts its request here
        put(_DONE)

    thread = threading.Thread(target=work, name="freetoken-mcp-turn", daemon=True)
    thread.start()
    try:
        while True:
            item, error = await queue.get()
            if item is _DONE:
                if error is not None:
                    raise error
                return
            yield item
    finally:
        stop.set()
