"""Client-driven CPU work off the event loop, on a thread pool of its own.

A request's parsing (a history of thousands of messages is seconds of pure Python: a 3.7 MB
body held every other client's stream for 0.4-3.6 s), a chat-template render for a count, a
tokenization: each runs as `await heavy(fn, *args)`. On a thread the event loop keeps serving
the other clients' streams (the parsing thread yields the GIL every few milliseconds). The
pool is its own, so asyncio's default pool, where /health, /metrics and a WebSocket's greeting
read the engine's figures, never waits behind them (eight counts of 10,000-message histories
held /health for 4.5 s, past a liveness probe's usual 1 s).
"""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

# Parsing and rendering are pure Python (one thread at a time holds the GIL): more workers
# than cores would only queue on it.
_POOL = ThreadPoolExecutor(
    max_workers=max(2, min(4, os.cpu_count() or 1)), thread_name_prefix="freetoken-heavy"
)


async def heavy(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` on the heavy-work pool; its exceptions are raised here."""
    return await asyncio.get_running_loop().run_in_executor(_POOL, functools.partial(fn, *args))
