"""Clients that leave, driven as raw ASGI: an HTTP client cannot time its disconnect to the
engine's state, so the server's view is played directly."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any


def _scope(path: str, length: int, session: str | None) -> dict:
    headers = [
        (b"host", b"testserver"),
        (b"content-type", b"application/json"),
        (b"content-length", str(length).encode()),
    ]
    if session is not None:
        headers.append((b"x-session-id", session.encode()))
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": headers,
        "client": ("127.0.0.1", 50000),
        "server": ("testserver", 80),
    }


async def _post(
    app: Any, path: str, body: bytes, session: str | None, leaving: Callable[[], Awaitable[None]]
) -> list[dict]:
    """POSTs `body` (X-Session-Id `session`); the client disconnects when `leaving()`
    returns. The ASGI messages the app sent."""
    sent: list[dict] = []
    delivered = False

    async def receive() -> dict:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await leaving()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    await app(_scope(path, len(body), session), receive, send)
    return sent


def post_and_leave(app: Any, path: str, body: bytes) -> list[dict]:
    """POSTs `body` to the server `app` at `path`, then disconnects once the engine runs the
    request (the server sees it while it collects the reply). Returns the ASGI messages the app
    sent; the caller closes the app's service."""
    service = app.state.server.service

    async def once_it_runs() -> None:
        while service.stats()["requests"]["running"] == 0:  # until it generates
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)

    return asyncio.run(asyncio.wait_for(_post(app, path, body, None, once_it_runs), timeout=60))


async def raw_post(
    app: Any, path: str, body: dict, session: str | None = None, leave: bool = False
) -> list[dict]:
    """POSTs JSON `body` to `app` at `path` as raw ASGI (with X-Session-Id `session`); with
    `leave` the client disconnects right after sending it, else it stays until the response
    ends. Returns the ASGI messages the app sent."""

    async def leaving() -> None:
        if not leave:
            await asyncio.Event().wait()  # until the app stops listening

    return await _post(app, path, json.dumps(body).encode(), session, leaving)
