"""Keep-alive for server-sent event streams: a comment line (`: keep-alive`) whenever a stream
has had nothing to send for KEEPALIVE_S seconds.

A long prefill (a 30k-token agent history with experts streamed from host memory takes tens
of seconds on a laptop), or a request queued behind others, leaves a stream silent after its
opening events. Proxies cut idle connections (nginx's proxy_read_timeout is 60 s by default)
and some clients give up on a silent read. SSE comments are skipped by every conforming
reader (the OpenAI and Anthropic SDKs, browsers' EventSource), so one form serves the OpenAI,
Anthropic and Responses streams alike.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import anyio

KEEPALIVE_S = 15.0
KEEPALIVE = ": keep-alive\n\n"


async def with_keepalive(body: AsyncIterator[str]) -> AsyncIterator[str]:
    """`body`'s items as they come, and KEEPALIVE after each KEEPALIVE_S seconds without one.
    Closing this closes `body` (its item in flight cancelled first)."""
    items = body.__aiter__()
    pending: asyncio.Future | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(items.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=KEEPALIVE_S)
            if not done:
                yield KEEPALIVE
                continue
            finished, pending = pending, None
            try:
                item = finished.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        # Shielded: a client that left cancels the response's task group, whose cancel scope
        # is delivered again at every await, and would cut this cleanup short.
        with anyio.CancelScope(shield=True):
            if pending is not None:  # a client that left: stop the item being made
                pending.cancel()
                await asyncio.wait({pending})
                if not pending.cancelled():
                    pending.exception()  # retrieved: nobody reads what it ended with
            closing = getattr(body, "aclose", None)
            if closing is not None:
                await closing()
