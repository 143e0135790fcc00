"""The web page: GET / (and /ui), one self-contained HTML file, no build step.

It opens the session WebSocket for an id, sends user messages (`append` mode, so the server
keeps the history), and shows reasoning, content, tool calls, usage and the engine's memory
split live. Any other socket on the same id (an agent) is shown too: the page is a watcher.
The page is public even with an API key (it holds no data; it asks for the key and offers it
as the `bearer.<key>` subprotocol, since browsers cannot set WebSocket headers). All model text
is inserted with textContent, never as HTML.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import HTMLResponse
from starlette.routing import Route

from freetoken_agent.integrations.server.ui_page import PAGE

PATHS = ("/", "/ui")


async def page(request: Request) -> HTMLResponse:
    return HTMLResponse(
        PAGE,
        headers={
            # The page runs only its own inline script and talks only to this server.
            "Content-Security-Policy": (
                "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                "connect-src 'self' ws: wss:; frame-ancestors 'none'"
            ),
            "X-Content-Type-Options": "nosniff",
        },
    )


routes = [Route(path, page, methods=["GET"]) for path in PATHS]
