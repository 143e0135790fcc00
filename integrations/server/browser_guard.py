"""Keeps other web pages from using a local server through the user's browser.

A server on 127.0.0.1 without a key is reachable by any page the user opens: browsers let a
page send a "simple" cross-origin POST (text/plain, which this server would still parse as
JSON) and open WebSockets to any origin (no CORS applies to them). Two checks close that:

- Origin: a request whose `Origin` header names another host than the one it was sent to
  comes from a foreign page; it gets 403. Programs (curl, SDKs) send no Origin and pass; the
  server's own web page is same-origin and passes.
- Host (optional, `allowed_hosts`): DNS rebinding makes a foreign name resolve to 127.0.0.1,
  so its page becomes "same-origin"; the Host header then carries that foreign name. `serve`
  turns this check on, with the local names, when it binds locally without a key.

`allowed_origins` names pages the user trusts on other origins (an agent UI on its own dev
server, `serve --allowed-origin http://localhost:5173`): they pass the Origin check, and the
app answers their CORS preflights (Starlette's CORSMiddleware, see app.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.websockets import WebSocket

from freetoken_agent.integrations.server.anthropic_errors import api_error_response

LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key == name:
            return value.decode("latin-1")
    return None


def _hostname(netloc: str) -> str:
    """'127.0.0.1:8000' -> '127.0.0.1', '[::1]:8000' -> '::1'."""
    return (urlsplit("//" + netloc).hostname or "").lower()


def normal_origin(origin: str) -> str:
    """An Origin as browsers send it: scheme://host[:port], lower case, no trailing slash.
    Raises ValueError for anything else (a path, no scheme)."""
    parts = urlsplit(origin.strip().rstrip("/"))
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.path:
        raise ValueError(f"{origin!r} is not an origin (scheme://host[:port])")
    return f"{parts.scheme}://{parts.netloc}".lower()


class BrowserGuard:
    def __init__(
        self,
        app: ASGIApp,
        allowed_hosts: Iterable[str] | None = None,
        allowed_origins: Iterable[str] = (),
    ) -> None:
        self.app = app
        self.allowed_hosts = None if allowed_hosts is None else {h.lower() for h in allowed_hosts}
        self.allowed_origins = {normal_origin(o) for o in allowed_origins}

    def problem(self, scope: Scope) -> tuple[str, str] | None:
        """(code, message) of what is wrong with the request, or None."""
        host = _header(scope, b"host") or ""
        if self.allowed_hosts is not None and _hostname(host) not in self.allowed_hosts:
            return "forbidden_host", (
                f"host {host!r} is not served here (allowed: {sorted(self.allowed_hosts)}); "
                "this guards a local server against DNS rebinding"
            )
        origin = _header(scope, b"origin")
        if (
            origin is not None
            and origin != "null"
            and urlsplit(origin).netloc.lower() != host.lower()
            and origin.lower().rstrip("/") not in self.allowed_origins
        ):
            return "forbidden_origin", (
                f"cross-origin request from {origin!r} refused: only same-origin pages, and "
                f"origins the server was started with (--allowed-origin), may call"
            )
        if origin == "null":
            return "forbidden_origin", (
                "requests from opaque origins (sandboxed pages, file://) are refused"
            )
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        problem = self.problem(scope)
        if problem is None:
            await self.app(scope, receive, send)
            return
        code, message = problem
        response = api_error_response(scope["path"], 403, message, code=code)
        if scope["type"] == "http":
            await response(scope, receive, send)
            return
        socket = WebSocket(scope, receive, send)
        if "websocket.http.response" in scope.get("extensions", {}):
            await socket.send_denial_response(response)
        else:
            await socket.close(code=1008, reason=message[:120])
