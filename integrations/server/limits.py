"""The request-size limit: a body over `max_bytes` gets 413 before any route sees it.

Chat histories grow, but a multi-megabyte body is a mistake or an attack, and a route that
reads it whole (json.loads) would hold it all in memory. The middleware buffers the body up to
the limit and answers 413 the moment it is passed (or at once, from Content-Length), then hands
the route the buffered body followed by the real channel, so routes can still notice a client
that disconnects later (streaming responses watch for it).

A body sent compressed (a Content-Encoding other than identity) gets 415 at once: the routes
read bodies as they come, so a gzip body would be refused as "not UTF-8" at its second byte,
which never names the encoding (and decoding it here would let a small body unpack past the
limit). OpenAI's clients, and vLLM's and llama.cpp's servers, send and read bodies plain.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from freetoken_agent.integrations.server.anthropic_errors import api_error_response

DEFAULT_MAX_BODY = 4 * 1024 * 1024  # 4 MiB: about a million tokens of chat history


def compressed(path: str, encoding: str):
    return api_error_response(
        path,
        415,
        f"the request body has Content-Encoding {encoding!r:.40}; this server reads bodies "
        "uncompressed only: send it without compression",
        code="unsupported_content_encoding",
    )


def too_large(path: str, limit: int):
    return api_error_response(
        path,
        413,
        f"the request body is larger than this server's limit of {limit} bytes "
        f"({limit / 2**20:.1f} MiB); shorten the history or raise --max-body-mb",
        code="request_too_large",
    )


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_BODY) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                await too_large(scope["path"], self.max_bytes)(scope, receive, send)
                return
            if name == b"content-encoding" and value.strip().lower() not in (b"", b"identity"):
                await compressed(scope["path"], value.decode("latin-1"))(scope, receive, send)
                return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await too_large(scope["path"], self.max_bytes)(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
