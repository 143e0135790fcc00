"""OpenAI-compatible routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models.

A chat completion is a TurnRun per choice (`n`, 1 by default: choices.py): the first on the
Session of `X-Session-Id` when the client sends one (turns then queue one behind the other, the
session's watchers see them, and its history keeps the first choice's reply), the others on
fresh Sessions. A text completion (the legacy endpoint: autocomplete, scripts) is a TextRun per
choice: its prompt goes to the engine as is, with no Session or chat template. Both are served
alike. Everything the engine could refuse is refused before the response starts, with 400 and
an OpenAI error object. A client that goes away ends its generation at once: a streamed
response cancels every choice when Starlette sees the disconnect, a non-streamed one watches
for it while it collects the replies (run_responses.py, which the Anthropic route shares;
`OpenAIWire` writes this API's side of it).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import replace
from datetime import datetime, timezone
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from freetoken_agent.engine.outputs import InvalidRequestError
from freetoken_agent.integrations.choice_sampling import choice_sampling
from freetoken_agent.integrations.openai_logprobs import PromptLogprobs, TextLogprobs, TokenStrings
from freetoken_agent.integrations.server.chat_request import (
    ChatRequest,
    check_model,
    parse_chat_request,
)
from freetoken_agent.integrations.server.choices import Choices
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
    unexpected_error_response,
)
from freetoken_agent.integrations.server.heavy_work import heavy
from freetoken_agent.integrations.server.run_responses import serve_choices
from freetoken_agent.integrations.server.text_request import TextRequest, parse_text_request
from freetoken_agent.integrations.server.text_run import TextRun
from freetoken_agent.integrations.server.turn_run import TurnRun
from freetoken_agent.session import Usage

log = logging.getLogger("freetoken.server")


Format = CompletionFormat | TextCompletionFormat


class OpenAIWire:
    """The OpenAI wire (run_responses.py): OpenAI error objects, `data:` chunks ending with
    `[DONE]`, the completion object."""

    def __init__(self, fmt: Format, include_usage: bool) -> None:
        self.fmt = fmt
        self.include_usage = include_usage

    def refused(self, error: InvalidRequestError) -> Response:
        return invalid_response(error)

    def failed(self, message: str, status: int = 500) -> Response:
        return error_response(status, message, "server_error")

    def stream(self, choices: Choices) -> AsyncIterator[str]:
        return _sse_chunks(choices, self.fmt, self.include_usage)

    def take(self, index: int, event: Any) -> None:
        pass  # the runs keep all a completion needs (their replies, usage and logprobs)

    def whole(self, choices: Choices) -> dict[str, Any]:
        return self.fmt.completion(choices.results(), choices.usage)


async def _sse_chunks(choices: Choices, fmt: Format, include_usage: bool):
    """Each choice's chunks as they come, its finish chunk when it ends; then the usage chunk
    (asked for) and [DONE]. A failed choice (the others cancelled) ends the stream with an
    error object instead of the chunks still to come."""
    for chunk in fmt.first_chunks(choices.n):
        yield sse(chunk)
    ended: set[int] = set()
    try:
        async for index, event in choices.events():
            if isinstance(event, Usage):
                ended.add(index)
                if choices.error is None:
                    yield sse(fmt.last_chunk(choices.finish_reason(index), index))
                continue
            delta = fmt.delta(event, index)
            if delta is not None:
                yield sse(fmt.chunk(delta, index=index))
    except Exception as e:  # noqa: BLE001 - the stream has started: report in-band
        log.exception("run failed while streaming")
        yield sse(error_body(f"{type(e).__name__}: {e}", "server_error"))
        yield sse("[DONE]")
        return
    if choices.error is not None:
        yield sse(error_body(choices.error, "server_error"))
    else:
        for index in sorted(set(range(choices.n)) - ended):  # one that ended without its Usage
            yield sse(fmt.last_chunk(choices.finish_reason(index), index))
        if include_usage:
            yield sse(fmt.usage_chunk(choices.usage))
    yield sse("[DONE]")


def _parse_chat(raw: bytes, state: Any) -> ChatRequest:
    body = parse_json_body(raw)
    return parse_chat_request(body, state.default_max_tokens, state.model_id, state.model_names)


def _parse_text(raw: bytes, state: Any) -> TextRequest:
    body = parse_json_body(raw)
    return parse_text_request(body, state.text_max_tokens, state.model_id, state.model_names)


async def chat_completions(request: Request) -> Response:
    state = request.app.state.server
    try:
        chat = await heavy(_parse_chat, await request.body(), state)
        live = state.hub.lookup(request.headers.get("x-session-id"))
    except InvalidRequestError as e:
        return invalid_response(e)
    except Exception as e:  # noqa: BLE001 - a checker's bug: still an OpenAI error object
        return unexpected_error_response(e, "read a request")
    shared = chat.n > 1
    turns = [
        replace(chat.turn, sampling=choice_sampling(chat.turn.sampling, i), shares_prompt=shared)
        for i in range(chat.n)
    ]
    lives = [live, *(state.hub.lookup(None) for _ in turns[1:])]
    sampling, strings = chat.turn.sampling, TokenStrings(state.service.tokenizer)
    runs = [TurnRun(on, turn) for on, turn in zip(lives, turns, strict=True)]
    choices = Choices(runs, shares_prompt=sampling.prompt_logprobs is None)
    k = sampling.prompt_logprobs  # as asked: echo, which would add to it, is not chat's
    fmt = CompletionFormat(
        state.model_id,
        strings if sampling.logprobs is not None else None,
        None if k is None else PromptLogprobs(strings, k),
    )
    return await serve_choices(request, choices, OpenAIWire(fmt, chat.include_usage), chat.stream)


async def text_completions(request: Request) -> Response:
    state = request.app.state.server
    try:
        text = await heavy(_parse_text, await request.body(), state)
    except InvalidRequestError as e:
        return invalid_response(e)
    except Exception as e:  # noqa: BLE001 - a checker's bug: still an OpenAI error object
        return unexpected_error_response(e, "read a request")
    # Each choice asks for what the request asks: with prompt entries (prompt_logprobs, echo's
    # logprobs) every choice computes them, as such a request reuses no cached prefix.
    samplings = [choice_sampling(text.sampling, i) for i in range(text.n)]
    shared = len(samplings) > 1
    runs = [TextRun(state.service, text.prompt, sp, text.echo, shared) for sp in samplings]
    choices = Choices(runs, shares_prompt=text.sampling.prompt_logprobs is None)
    k, asked = text.sampling.logprobs, text.prompt_logprobs
    strings = TokenStrings(state.service.tokenizer)
    fmt = TextCompletionFormat(
        state.model_id,
        None if k is None else TextLogprobs(strings, k > 0),
        None if asked is None else PromptLogprobs(strings, asked),
    )
    return await serve_choices(request, choices, OpenAIWire(fmt, text.include_usage), text.stream)


def model_card(state: Any) -> dict[str, Any]:
    """The served model as both APIs list one: OpenAI's fields (object, created, owned_by)
    and Anthropic's (type, display_name, created_at), so either SDK's `models` reads it whole;
    each ignores the other's."""
    created_at = datetime.fromtimestamp(state.created, timezone.utc)
    return {
        "id": state.model_id,
        "object": "model",
        "created": state.created,
        "owned_by": "freetoken",
        "max_model_len": state.max_model_len,
        "type": "model",
        "display_name": state.model_id,
        "created_at": created_at.isoformat().replace("+00:00", "Z"),
    }


async def list_models(request: Request) -> Response:
    state = request.app.state.server
    card = model_card(state)
    # OpenAI's list, with Anthropic's page fields (one page: no more to fetch).
    page = {"has_more": False, "first_id": card["id"], "last_id": card["id"]}
    return JSONResponse({"object": "list", "data": [card], **page})


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
