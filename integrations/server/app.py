"""create_app: the Starlette application serving one engine.

    app = create_app(engine_or_service, api_key=None)
    uvicorn.run(app, host="127.0.0.1", port=8000)       # or `freetoken serve`

Routes: POST /v1/chat/completions, POST /v1/completions (legacy text completions), GET
/v1/models, POST /v1/responses (OpenAI's Responses API; GET and DELETE /v1/responses/{id},
GET /v1/responses/{id}/input_items, POST /v1/responses/input_tokens), POST /v1/messages and
/v1/messages/count_tokens (Anthropic's Messages API), GET
/health, GET /metrics (Prometheus), POST /tokenize and /detokenize (vLLM's), WebSocket
/v1/sessions/{id}/ws, and the web page at / (also /ui). Any other path (404) or method (405)
gets an OpenAI error object too (Anthropic's under /v1/messages), as OpenAI answers an unknown
URL: clients read the message from it (the SDKs show it in their NotFoundError), not from a
plain-text body.

One model is served, under `model_id` (default `freetoken/<arch>`; `freetoken serve` passes the
model folder's name, or `freetoken-demo`). A request's `model` must name it or one of its
aliases: the default `freetoken/<arch>` id and whatever `model_aliases` adds (e.g. a folder
name, or "gpt-4o" for a client that cannot be told another name). Any other name is refused
with 404 `model_not_found`, as OpenAI does: a client pointed at the wrong server, or asking for
a model this one does not have, learns it at once instead of getting another model's answers.
A request without `model` (or with null) gets the served one. Middleware, outermost first:
BrowserGuard (foreign pages and DNS rebinding), BearerAuth (when `api_key` is set), BodyLimit
(413 past `max_body_bytes`). Given an Engine, the app uses the engine's one EngineService
(`shared_service`), held by the app and released at shutdown (the last holder closes a service
made that way); given a service, or an engine whose service its maker made by hand, the caller
owns it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from freetoken_agent.chat_format import ChatFormat
from freetoken_agent.engine.outputs import EngineClosedError
from freetoken_agent.integrations.server import (
    anthropic_routes,
    memory_routes,
    metrics_route,
    openai_routes,
    responses_routes,
    sessions_ws,
    tokenize_routes,
    ui,
)
from freetoken_agent.integrations.server.anthropic_errors import api_error_response
from freetoken_agent.integrations.server.auth import KEYED, BearerAuth
from freetoken_agent.integrations.server.browser_guard import BrowserGuard, normal_origin
from freetoken_agent.integrations.server.hub import SessionHub
from freetoken_agent.integrations.server.limits import DEFAULT_MAX_BODY, BodyLimit
from freetoken_agent.integrations.server.responses_store import ResponseStore
from freetoken_agent.integrations.server.text_request import (
    DEFAULT_MAX_TOKENS as TEXT_DEFAULT_MAX_TOKENS,
)
from freetoken_agent.service import EngineService, shared_service


@dataclass(slots=True)
class ServerState:
    """What every route reads, as `request.app.state.server`."""

    service: EngineService
    hub: SessionHub
    model_id: str
    model_names: frozenset[str]  # model_id and its aliases: what a request may name
    max_model_len: int
    default_max_tokens: int
    text_max_tokens: int  # the same for text completions (16 unless the server was given one)
    max_body_bytes: int
    created: int
    owns_service: bool
    responses: ResponseStore = field(default_factory=ResponseStore)  # previous_response_id


async def http_error(request: Request, exc: HTTPException) -> Response:
    """Starlette's own refusals (no such route, a method the route does not take)."""
    where = f"{request.method} {request.url.path}"
    if exc.status_code == 404:
        message = f"Invalid URL ({where}): this server has no such route"
    elif exc.status_code == 405:
        message = f"Invalid method ({where}): this route takes {exc.headers.get('Allow', '')}"
    else:
        message = f"{exc.detail} ({where})"
    return api_error_response(request.url.path, exc.status_code, message, headers=exc.headers)


async def health(request: Request) -> JSONResponse:
    """200 and the server's figures while it serves; 503 naming why once its engine service
    stopped (closed, or the engine failed MAX_FAILURES steps in a row), so a supervisor or a
    load balancer sees it: every generation would fail. Under an API key, a request without
    it gets the status alone (auth.py)."""
    state: ServerState = request.app.state.server
    if not request.scope.get("state", {}).get(KEYED, True):
        why = state.service.why_closed
        return JSONResponse(
            {"status": "ok" if why is None else "closed"}, 200 if why is None else 503
        )
    try:
        why = state.service.why_closed
        stats = None if why is not None else await asyncio.to_thread(state.service.stats)
    except EngineClosedError as e:  # closed in between
        why, stats = str(e), None
    if stats is None:
        return JSONResponse({"status": "closed", "reason": why, "model": state.model_id}, 503)
    return JSONResponse(
        {
            "status": "ok",
            "model": state.model_id,
            "sessions": len(state.hub),
            "memory": stats.get("memory"),
            "requests": stats.get("requests"),
            "tokens": stats.get("tokens"),
            "experts": stats.get("experts"),
        }
    )


def create_app(
    engine: Any,
    *,
    api_key: str | None = None,
    model_id: str | None = None,
    model_aliases: Sequence[str] = (),
    max_body_bytes: int = DEFAULT_MAX_BODY,
    max_sessions: int = 256,
    default_max_tokens: int | None = None,
    allowed_hosts: Sequence[str] | None = None,
    allowed_origins: Sequence[str] = (),
) -> Starlette:
    """`engine`: an Engine or an EngineService. `default_max_tokens` applies when a request
    gives none (default: the engine's whole context, which then ends the generation; for text
    completions 16, that endpoint's default at OpenAI and vLLM).
    `model_aliases`: other names a request's `model` may use for the served model.
    `allowed_hosts`: accepted Host header names (None: any; `serve` restricts a keyless local
    server to the local names). `allowed_origins`: web pages on other origins that may call
    the server from a browser (scheme://host[:port]; CORS preflights answered for them)."""
    origins = [normal_origin(o) for o in allowed_origins]  # ValueError: not an origin
    service, owns = shared_service(engine)
    try:
        if service.tokenizer is None:
            raise ValueError("the server needs a model folder with a tokenizer and chat template")
        chat_format = ChatFormat(service.tokenizer)
        max_len = int(service.engine.max_model_len)
    except BaseException:
        if owns:
            service.release()
        raise
    default_id = f"freetoken/{service.spec.arch}"
    model_id = model_id or default_id
    state = ServerState(
        service=service,
        hub=SessionHub(service, chat_format, max_sessions),
        model_id=model_id,
        model_names=frozenset([model_id, default_id, *model_aliases]),
        max_model_len=max_len,
        default_max_tokens=default_max_tokens or max_len,
        text_max_tokens=default_max_tokens or TEXT_DEFAULT_MAX_TOKENS,
        max_body_bytes=max_body_bytes,
        created=int(time.time()),
        owns_service=owns,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        yield
        if state.owns_service:  # a holder (shared_service): the last one closes it
            await asyncio.to_thread(service.release)

    middleware = []
    if origins:
        # Outermost: a preflight (OPTIONS, no credentials) is answered before the guard and
        # the key check; the allowed pages' real requests then pass both as any client's do.
        middleware.append(Middleware(CORSMiddleware, allow_origins=origins, allow_methods=["*"],
                                     allow_headers=["*"]))  # fmt: skip
    middleware.append(
        Middleware(BrowserGuard, allowed_hosts=allowed_hosts, allowed_origins=origins)
    )
    if api_key is not None:
        middleware.append(Middleware(BearerAuth, api_key=api_key, public_paths=ui.PATHS,
                                     probe_paths=("/health",)))  # fmt: skip
    middleware.append(Middleware(BodyLimit, max_bytes=max_body_bytes))
    routes = [
        *openai_routes.routes,
        *anthropic_routes.routes,
        *responses_routes.routes,
        *sessions_ws.routes,
        *memory_routes.routes,
        *metrics_route.routes,
        *tokenize_routes.routes,
        Route("/health", health, methods=["GET"]),
        *ui.routes,
    ]
    app = Starlette(
        routes=routes,
        middleware=middleware,
        lifespan=lifespan,
        exception_handlers={HTTPException: http_error},
    )
    app.state.server = state
    return app
