"""Anthropic's Messages API: POST /v1/messages and POST /v1/messages/count_tokens.

Coding assistants (Claude Code, pointed here with ANTHROPIC_BASE_URL) and other agent tools
speak it. A message is a chat turn like any other: the body is translated into an OpenAI chat
body and checked by the chat route's code (anthropic_request.py), run as a TurnRun (on the
Session of `X-Session-Id` when one is sent, else a fresh one), and served by the same
machinery (run_responses.py: refusals before anything is sent, a disconnect cancels the run).
Only the wire is Anthropic's (`AnthropicWire`): named SSE events or one message
(anthropic_format.py), and Anthropic's error objects (anthropic_errors.py); an error after a
stream started is an `error` event, which ends it.

count_tokens answers {"input_tokens": n} for the same body without max_tokens: the history
rendered with its tools as a message's prompt is, so n is what that message's usage counts as
input (input_tokens plus cache_read_input_tokens), what the turn appends to its prompt (a
forced tool_choice's opener: tool_choice.py) included (input_count.py).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from freetoken_agent.engine.outputs import InvalidRequestError
from freetoken_agent.integrations.server.anthropic_errors import (
    anthropic_error_response,
    anthropic_invalid_response,
)
from freetoken_agent.integrations.server.anthropic_format import MessageFormat
from freetoken_agent.integrations.server.anthropic_request import (
    anthropic_refusal,
    parse_messages_request,
)
from freetoken_agent.integrations.server.choices import Choices
from freetoken_agent.integrations.server.errors import parse_json_body
from freetoken_agent.integrations.server.heavy_work import heavy
from freetoken_agent.integrations.server.input_count import turn_input_tokens
from freetoken_agent.integrations.server.named_stream import cut_short, named_events
from freetoken_agent.integrations.server.run_responses import serve_choices
from freetoken_agent.integrations.server.turn_run import TurnRun

log = logging.getLogger("freetoken.server")


class AnthropicWire:
    """The Anthropic wire (run_responses.py) of one message."""

    def __init__(self, fmt: MessageFormat, origins: list[str]) -> None:
        self.fmt = fmt
        self.origins = origins  # the translated history's origins, to name a refused message

    def refused(self, error: InvalidRequestError) -> Response:
        return anthropic_invalid_response(anthropic_refusal(error, self.origins))

    def failed(self, message: str, status: int = 500) -> Response:
        return anthropic_error_response(status, message)

    def stream(self, choices: Choices) -> AsyncIterator[str]:
        (run,) = choices.runs
        return named_events(choices, self.fmt, [self.fmt.start(run.prompt_tokens or 0)])

    def take(self, index: int, event: Any) -> None:
        self.fmt.add(event)  # the blocks in the order they came, as a stream opens them

    def whole(self, choices: Choices) -> dict[str, Any] | Response:
        """The message; a run cut short (anthropic_format.MessageFormat.end) is an error: 500
        when the engine was closed, 499 for a cancel (a 4xx: the SDKs do not send it again)."""
        (run,) = choices.runs
        why = cut_short(run.usage)
        if why is not None:
            return anthropic_error_response(500 if run.usage.error else 499, why)
        return self.fmt.message(run.finish_reason(), run.usage)


def _parse_message(raw: bytes, state: Any) -> Any:
    return parse_messages_request(
        parse_json_body(raw),
        state.default_max_tokens,
        state.model_id,
        state.model_names,
        budgets=getattr(state.service.engine, "thinking", None) is not None,
    )


async def create_message(request: Request) -> Response:
    state = request.app.state.server
    try:
        parsed = await heavy(_parse_message, await request.body(), state)
        live = state.hub.lookup(request.headers.get("x-session-id"))
    except InvalidRequestError as e:
        return anthropic_invalid_response(e)
    except Exception as e:  # noqa: BLE001 - a checker's bug: still an Anthropic error object
        log.exception("could not read a request")
        return anthropic_error_response(500, f"{type(e).__name__}: {e}")
    choices = Choices([TurnRun(live, parsed.chat.turn)])
    max_tokens = parsed.chat.turn.sampling.max_tokens
    wire = AnthropicWire(MessageFormat(state.model_id, max_tokens), parsed.origins)
    return await serve_choices(request, choices, wire, parsed.chat.stream)


def _input_tokens(raw: bytes, state: Any) -> int:
    parsed = parse_messages_request(
        parse_json_body(raw),
        state.default_max_tokens,
        state.model_id,
        state.model_names,
        counting=True,
    )
    try:
        return turn_input_tokens(parsed.chat.turn, state)
    except InvalidRequestError as e:  # the template's or a tool schema's refusal
        raise anthropic_refusal(e, parsed.origins) from None


async def count_tokens(request: Request) -> Response:
    state = request.app.state.server
    try:
        raw = await request.body()
        # A long history's parsing and render are CPU work: off the event loop.
        return JSONResponse({"input_tokens": await heavy(_input_tokens, raw, state)})
    except InvalidRequestError as e:
        return anthropic_invalid_response(e)
    except Exception as e:  # noqa: BLE001 - a checker's bug: still an Anthropic error object
        log.exception("could not count tokens")
        return anthropic_error_response(500, f"{type(e).__name__}: {e}")


routes = [
    Route("/v1/messages", create_message, methods=["POST"]),
    Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
]
