"""OpenAI's Responses API: POST /v1/responses, which the OpenAI Agents SDK (its default model
class) and Codex speak. A response is a chat turn like any other: the body is translated into
an OpenAI chat body and checked by the chat route's code (responses_request.py), run as a
TurnRun (on the Session of `X-Session-Id` when one is sent, else a fresh one), and served by the
same machinery as the other routes (run_responses.py: refusals before anything is sent, a
disconnect cancels the run). Only the wire is the Responses API's (`ResponsesWire`): named SSE
events or one response object (responses_format.py), with OpenAI's error objects. A response
that ends well is kept (responses_store.py) unless the request said `store: false`, so a later
request may continue it with `previous_response_id`, read it back (GET /v1/responses/{id}), list
its input items (GET /v1/responses/{id}/input_items) or delete it (DELETE /v1/responses/{id}).
POST /v1/responses/input_tokens counts the input tokens of a body without running it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from freetoken_agent.engine.outputs import InvalidRequestError
from freetoken_agent.integrations.openai_logprobs import TokenStrings
from freetoken_agent.integrations.server.choices import Choices
from freetoken_agent.integrations.server.errors import (
    error_response,
    invalid_response,
    parse_json_body,
    unexpected_error_response,
)
from freetoken_agent.integrations.server.heavy_work import heavy
from freetoken_agent.integrations.server.input_count import turn_input_tokens
from freetoken_agent.integrations.server.named_stream import cut_short, named_events
from freetoken_agent.integrations.server.responses_format import ResponseFormat
from freetoken_agent.integrations.server.responses_listing import listed_items, page
from freetoken_agent.integrations.server.responses_request import (
    ResponsesRequest,
    parse_responses_request,
    responses_refusal,
)
from freetoken_agent.integrations.server.responses_store import StoredResponse
from freetoken_agent.integrations.server.run_responses import serve_choices
from freetoken_agent.integrations.server.turn_run import TurnRun


class ResponsesWire:
    """The Responses wire (run_responses.py) of one response."""

    def __init__(self, fmt: ResponseFormat, origins: list[str]) -> None:
        self.fmt = fmt
        self.origins = origins  # the translated history's origins, to name a refused item

    def refused(self, error: InvalidRequestError) -> Response:
        return invalid_response(responses_refusal(error, self.origins))

    def failed(self, message: str, status: int = 500) -> Response:
        return error_response(status, message, "server_error")

    def stream(self, choices: Choices) -> AsyncIterator[str]:
        return named_events(choices, self.fmt, self.fmt.start())

    def take(self, index: int, event: Any) -> None:
        self.fmt.add(event)  # the items in the order they came, as a stream opens them

    def whole(self, choices: Choices) -> dict[str, Any] | Response:
        (run,) = choices.runs
        if cut_short(run.usage) is not None and run.usage.error:  # the engine was closed
            return self.failed(run.usage.error)
        return self.fmt.whole(run.finish_reason(), run.usage)


async def create_response(request: Request) -> Response:
    state = request.app.state.server
    try:
        body, parsed = await heavy(_parse_response, await request.body(), state)
        live = state.hub.lookup(request.headers.get("x-session-id"))
    except InvalidRequestError as e:
        return invalid_response(e)
    except Exception as e:  # noqa: BLE001 - a checker's bug: still an OpenAI error object
        return unexpected_error_response(e, "read a request")
    choices = Choices([TurnRun(live, parsed.chat.turn)])

    own = listed_items(parsed.own)

    def keep(response: dict[str, Any]) -> None:
        conversation = [*parsed.items, *response["output"]]
        state.responses.put(StoredResponse(response, own, conversation))

    asked = parsed.chat.turn.sampling.logprobs is not None
    strings = TokenStrings(state.service.tokenizer) if asked else None
    wire = ResponsesWire(ResponseFormat(state.model_id, body, keep, strings), parsed.origins)
    return await serve_choices(request, choices, wire, parsed.chat.stream)


def _parse_response(raw: bytes, state: Any) -> tuple[Any, ResponsesRequest]:
    body = parse_json_body(raw)
    parsed = parse_responses_request(
        body, state.default_max_tokens, state.model_id, state.model_names, state.responses
    )
    return body, parsed


def _input_tokens(raw: bytes, state: Any) -> int:
    _, parsed = _parse_response(raw, state)
    try:
        return turn_input_tokens(parsed.chat.turn, state)
    except InvalidRequestError as e:  # the template's or a tool schema's refusal
        raise responses_refusal(e, parsed.origins) from None


async def count_input_tokens(request: Request) -> Response:
    """POST /v1/responses/input_tokens: the input tokens a response to this body would take
    (input_count.py), for the same body as POST /v1/responses (max_output_tokens and stream
    are read and not needed)."""
    state = request.app.state.server
    try:
        n = await heavy(_input_tokens, await request.body(), state)  # parse, render: off the loop
    except InvalidRequestError as e:
        return invalid_response(e)
    except Exception as e:  # noqa: BLE001 - a checker's bug: still an OpenAI error object
        return unexpected_error_response(e, "count input tokens")
    return JSONResponse({"object": "response.input_tokens", "input_tokens": n})


def _stored(request: Request) -> StoredResponse:
    """The kept response the path names; 404 (OpenAI's) when it is not kept."""
    response_id = request.path_params["response_id"]
    stored = request.app.state.server.responses.get(response_id)
    if stored is None:
        raise _NotKept(response_id)
    return stored


class _NotKept(InvalidRequestError):
    def __init__(self, response_id: str) -> None:
        super().__init__(
            f"Response with id {response_id!r:.80} not found (this server keeps the responses "
            "it served, but not those with store false, in memory for its life)"
        )


def _not_found(error: _NotKept) -> Response:
    return error_response(404, str(error))


async def retrieve_response(request: Request) -> Response:
    try:
        stored = _stored(request)
    except _NotKept as e:
        return _not_found(e)
    if request.query_params.get("stream") in ("true", "1"):
        return error_response(400, "stream is not supported when reading a response back: the "
                              "response has ended; read it whole", param="stream")  # fmt: skip
    return JSONResponse(stored.response)


async def list_input_items(request: Request) -> Response:
    try:
        return JSONResponse(page(_stored(request).input, request.query_params))
    except _NotKept as e:
        return _not_found(e)
    except InvalidRequestError as e:
        return invalid_response(e)


async def delete_response(request: Request) -> Response:
    response_id = request.path_params["response_id"]
    if not request.app.state.server.responses.delete(response_id):
        return _not_found(_NotKept(response_id))
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


routes = [
    Route("/v1/responses", create_response, methods=["POST"]),
    # Before the {response_id} routes, which would take "input_tokens" for an id.
    Route("/v1/responses/input_tokens", count_input_tokens, methods=["POST"]),
    Route("/v1/responses/{response_id}", retrieve_response, methods=["GET"]),
    Route("/v1/responses/{response_id}", delete_response, methods=["DELETE"]),
    Route("/v1/responses/{response_id}/input_items", list_input_items, methods=["GET"]),
]
