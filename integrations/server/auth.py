"""API-key authentication for HTTP and WebSocket, as one ASGI middleware.

A server with `api_key` refuses every request that does not carry it, with 401 and an OpenAI
error object (`invalid_api_key`; under /v1/messages Anthropic's `authentication_error`), before
the body is read. The key comes as `Authorization: Bearer KEY` (OpenAI's SDKs, and Claude Code
given ANTHROPIC_AUTH_TOKEN) or as `x-api-key: KEY` (Anthropic's SDKs). Browsers cannot set
headers on a WebSocket, so a socket may instead offer the subprotocol `bearer.<key>` beside
`freetoken` (the web page offers ["freetoken", "bearer.<key>"]); the endpoint answers with
`freetoken`, never echoing the key. A browser socket must offer both: one that offers
`bearer.<key>` alone gets no subprotocol back, and browsers fail such a handshake.
The web page itself is public: it holds no data and asks for the key. So is /health's
status (`probe_paths`), as vLLM's and llama.cpp's servers leave it, so that a supervisor's or
Kubernetes' probe needs no key; its figures (sessions, memory, requests) are shown only with
the key (`KEYED`, set in the request's state).

Keys are compared in constant time (hmac.compare_digest), so timing reveals nothing about them.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable

from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.websockets import WebSocket

from freetoken_agent.integrations.server.anthropic_errors import api_error_response

BEARER_PROTOCOL = "bearer."
KEYED = "freetoken_keyed"  # request.state's flag: the request carried the right key


def offered_keys(scope: Scope) -> list[str]:
    """The keys a request presents: `Authorization: Bearer KEY`, `x-api-key: KEY`, and for a
    WebSocket the subprotocol `bearer.KEY`. Any of them may be the right one: the Anthropic
    SDK sends both headers when given both an api_key and an auth_token."""
    keys = []
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                keys.append(token.strip())
        elif name == b"x-api-key" and value.strip():
            keys.append(value.decode("latin-1").strip())
    if scope["type"] == "websocket":
        for protocol in scope.get("subprotocols", []):
            if protocol.startswith(BEARER_PROTOCOL):
                keys.append(protocol[len(BEARER_PROTOCOL) :])
    return keys


class BearerAuth:
    def __init__(
        self,
        app: ASGIApp,
        api_key: str,
        public_paths: Iterable[str] = (),
        probe_paths: Iterable[str] = (),
    ) -> None:
        if not api_key:
            raise ValueError("an empty api_key would accept anyone; pass None to disable auth")
        self.app = app
        self._key = api_key.encode("utf-8")
        self.public_paths = frozenset(public_paths)
        self.probe_paths = frozenset(probe_paths)  # served to anyone, told whether keyed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or scope["path"] in self.public_paths:
            await self.app(scope, receive, send)
            return
        keys = offered_keys(scope)
        # Every key is compared (constant time each), not only until one matches.
        keyed = bool(sum(hmac.compare_digest(k.encode("utf-8"), self._key) for k in keys))
        if keyed or scope["path"] in self.probe_paths:
            scope.setdefault("state", {})[KEYED] = keyed
            await self.app(scope, receive, send)
            return
        message = (
            "missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'"
            if not keys
            else "wrong API key"
        )
        response = api_error_response(
            scope["path"],
            401,
            message,
            code="invalid_api_key",
            headers={"WWW-Authenticate": 'Bearer realm="freetoken"'},
        )
        if scope["type"] == "http":
            await response(scope, receive, send)
            return
        socket = WebSocket(scope, receive, send)
        if "websocket.http.response" in scope.get("extensions", {}):
            await socket.send_denial_response(response)  # the client sees the 401 itself
        else:
            await socket.close(code=1008, reason=message)  # policy violation
