"""OpenAI-compatible routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models.

A chat completion is one TurnRun: on the Session of `X-Session-Id` when the client sends one
(turns then queue one behind the other, and the session's watchers see them), else on a fresh
Session. A text completion (the legacy endpoint: autocomplete, scripts) is one TextRun: its
prompt goes to the engine as is, with no Session or chat template. Both are served alike.
Everything the engine could refuse is refused before the response starts, with 400 and an
OpenAI error object. A client that goes away ends its generation at once: a streamed response
cancels the run when Starlette sees the disconnect, a non-streamed one watches for it while it
collects the reply.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from freetoken_agent.engine.outputs import InvalidRequestError
from freetoken_agent.integrations.openai_logprobs import TextLogprobs, TokenStrings
from freetoken_agent.integrations.server.chat_request import check_model, parse_chat_request
from freetoken_agent.integrations.server.completion_format import (
    CompletionFormat,
    TextCompletionFormat,
    sse,
)
from freetoken_agent.integrations.server.errors import (
    error_body,
    error_response,
    invalid_response,
    parse_json_body,
)
from freetoken_agent.integrations.server.text_request import parse_text_request
from freetoken_agent.integrations.server.text_run import TextRun
from freetoken_agent.integrations.server.turn_run import TurnRun
from freetoken_agent.session import Usage

log = logging.getLogger("freetoken.server")


Run = TurnRun | TextRun  # what the routes serve: `start`, `events`, `cancel`, the outcome
Format = CompletionFormat | TextCompletionFormat


class TurnStreamResponse(StreamingResponse):
    """An SSE response that cancels its run however it ends: finished, failed, or cut off
    by a client that left (also before the first chunk, when the body generator never ran)."""

    def __init__(self, run: Run, content: AsyncIterator[str]) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.run = run

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.run.cancel()


async def _sse_chunks(run: Run, fmt: Format, include_usage: bool):
    for chunk in fmt.first_chunks():
        yield sse(chunk)
    usage: Usage | None = None
    try:
        async for event in run.events():
            if isinstance(event, Usage):
                usage = event
                continue
            delta = fmt.delta(event)
            if delta is not None:
                yield sse(fmt.chunk(delta))
    except Exception as e:  # noqa: BLE001 - the stream has started: report in-band
        log.exception("run failed while streaming")
        yield sse(error_body(f"{type(e).__name__}: {e}", "server_error"))
        yield sse("[DONE]")
        return
    if usage is not None and usage.finish_reason == "error":
        yield sse(error_body(usage.error or "the engine failed this request", "server_error"))
    else:
        yield sse(fmt.last_chunk(run.finish_reason()))
        if include_usage:
            yield sse(fmt.usage_chunk(usage))
    yield sse("[DONE]")


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the body was read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _complete(request: Request, run: Run, fmt: Format) -> Response:
    async def collect() -> None:
        async for _ in run.events():
            pass

    collector = asyncio.ensure_future(collect())
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not collector.done():
            collector.cancel()
        run.cancel()
    if not collector.done() or collector.cancelled():
        return Response(status_code=499)  # the client left; nobody reads this
    if collector.exception() is not None:
        e = collector.exception()
        log.error("run failed: %s: %s", type(e).__name__, e)
        return error_response(500, f"{type(e).__name__}: {e}", "server_error")
    usage = run.usage
    if usage is not None and usage.finish_reason == "error":
        return error_response(500, usage.error or "the engine failed this request", "server_error")
    return JSONResponse(fmt.completion(run.reply, usage, run.finish_reason(), run.logprobs))


async def _serve(
    request: Request, run: Run, fmt: Format, stream: bool, include_usage: bool
) -> Response:
    """Start the run (refusals: 400), then stream it or collect it; it is cancelled however
    this ends, by the stream once that has taken it over."""
    handed_over = False
    try:
        try:
            await run.start()
        except InvalidRequestError as e:
            return invalid_response(e)
        except Exception as e:  # noqa: BLE001 - e.g. the grammar library is missing
            log.exception("could not start a run")
            return error_response(500, f"{type(e).__name__}: {e}", "server_error")
        if stream:
            handed_over = True
            return TurnStreamResponse(run, _sse_chunks(run, fmt, include_usage))
        return await _complete(request, run, fmt)
    finally:
        if not handed_over:
            run.cancel()


async def chat_completions(request: Request) -> Response:
    state = request.app.state.server
    try:
        body = parse_json_body(await request.body())
        chat = parse_chat_request(body, state.default_max_tokens, state.model_id, state.model_names)
        live = state.hub.lookup(request.headers.get("x-session-id"))
    except InvalidRequestError as e:
        return invalid_response(e)
    except Exception as e:  # noqa: BLE001 - a checker's bug: still an OpenAI error object
        log.exception("could not read a request")
        return error_response(500, f"{type(e).__name__}: {e}", "server_error")
    run = TurnRun(live, chat.turn)
    asked = chat.turn.sampling.logprobs is not None
    fmt = CompletionFormat(state.model_id, TokenStrings(state.service.tokenizer) if asked else None)
    return await _serve(request, run, fmt, chat.stream, chat.include_usage)


async def text_completions(request: Request) -> Response:
    state = request.app.state.server
    try:
        body = parse_json_body(await request.body())
        text = parse_text_request(body, state.text_max_tokens, state.model_id, state.model_names)
    except InvalidRequestError as e:
        return invalid_response(e)
    except Exception as e:  # noqa: BLE001 - a checker's bug: still an OpenAI error object
        log.exception("could not read a request")
        return error_response(500, f"{type(e).__name__}: {e}", "server_error")
    run = TextRun(state.service, text.prompt, text.sampling)
    k = text.sampling.logprobs
    writer = None if k is None else TextLogprobs(TokenStrings(state.service.tokenizer), k > 0)
    fmt = TextCompletionFormat(state.model_id, writer)
    return await _serve(request, run, fmt, text.stream, text.include_usage)


def model_card(state: Any) -> dict[str, Any]:
    return {
        "id": state.model_id,
        "object": "model",
        "created": state.created,
        "owned_by": "freetoken",
        "max_model_len": state.max_model_len,
    }


async def list_models(request: Request) -> Response:
    state = request.app.state.server
    return JSONResponse({"object": "list", "data": [model_card(state)]})


async def get_model(request: Request) -> Response:
    state = request.app.state.server
    try:
        check_model(request.path_params["model"], state.model_id, state.model_names)
    except InvalidRequestError as e:
        return invalid_response(e)
    return JSONResponse(model_card(state))


routes = [
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/completions", text_completions, methods=["POST"]),
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/models/{model:path}", get_model, methods=["GET"]),
]
