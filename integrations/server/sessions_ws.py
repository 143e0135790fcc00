"""The WebSocket session stream: /v1/sessions/{session_id}/ws.

The client sends JSON messages:

    {"type": "send", "messages": [...], "tools": [...], "tool_choice": ...,
     "sampling": {"max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
                  "stop_token_ids", "include_stop_str_in_output", "ignore_eos",
                  "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p",
                  "min_tokens", "thinking_token_budget", "logit_bias", "logprobs",
                  "top_logprobs"},
     "response_format": {...}, "append": false, "continue_final_message": false,
     "chat_template_kwargs": {"enable_thinking": false}, "model": "..."}
    {"type": "cancel"}                     interrupt the running turn (any watcher may)

`messages` is the whole history (OpenAI form), as agents resend it every turn; with `"append":
true` it is only what is new, added to the history the session kept from its last finished turn
(its messages and the reply; for a turn interrupted after writing something, what it wrote,
without the calls it began), and a send that names no `tools` keeps the tools of the session's
last turn (`"tools": []` offers none). `model` is optional; given, it must name the served model
or an alias (else an `error` with code `model_not_found`). The server answers with the events of
`session_events` (start, reasoning, content, tool_call, tool_result, usage, memory, done, ...),
published to every socket open on the same id, so a second socket watches the session live.
`"continue_final_message": true` has the model go on from the last message, the assistant's (a
prefill, as on the chat route); the history then keeps that message with the reply appended to
it. `chat_template_kwargs.enable_thinking` switches the template's thinking
mode for the turn, as on the chat route (absent: the template's default).
Problems with one message (bad JSON, a bad history, a busy session) go back to its sender as an
`error` and a `done`; the socket stays open. A socket that closes cancels the turn it started.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from freetoken_agent.engine.outputs import InvalidRequestError
from freetoken_agent.integrations.server.anthropic_messages import with_origins
from freetoken_agent.integrations.server.bridge import TurnCancelled
from freetoken_agent.integrations.server.chat_request import (
    TurnRequest,
    check_model,
    turn_from,
)
from freetoken_agent.integrations.server.errors import (
    BadParam,
    body_flag,
    describe_invalid,
    parse_json_body,
)
from freetoken_agent.integrations.server.heavy_work import heavy
from freetoken_agent.integrations.server.hub import LiveSession, Watcher
from freetoken_agent.integrations.server.session_events import error_json, memory_json
from freetoken_agent.integrations.server.turn_run import TurnRun
from freetoken_agent.messages import to_openai_messages

log = logging.getLogger("freetoken.server")
PROTOCOL = "freetoken"  # the subprotocol the server accepts (see auth.py for bearer.<key>)
SAMPLING_KEYS = frozenset(
    {
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop",
        "stop_token_ids",
        "include_stop_str_in_output",
        "ignore_eos",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "min_p",
        "min_tokens",
        "thinking_token_budget",
        "logit_bias",
        "logprobs",  # the chat API's: true, with top_logprobs k (a `logprob` event a token)
        "top_logprobs",
    }
)


# The fields of a `send` message. Any other is refused, as a misspelt sampling option is: an
# OpenAI-minded client puts max_tokens or temperature at the top, and a turn that ignored them
# (generating to the whole context) would look like a server that does not listen.
SEND_KEYS = frozenset(
    {
        "type",
        "messages",
        "tools",
        "tool_choice",
        "sampling",
        "response_format",
        "append",
        "continue_final_message",
        "chat_template_kwargs",  # {"enable_thinking": true or false}, as on the chat route
        "model",
    }
)


_INLINE_BYTES = 64 * 1024  # frames parsed on the event loop; larger ones on heavy_work's pool


def turn_request(msg: dict[str, Any], live: LiveSession, state: Any) -> TurnRequest:
    """The turn a `send` message asks for; `model`, when given, must name the served one."""
    unknown = sorted(set(msg) - SEND_KEYS)
    if unknown:
        raise BadParam(
            f"unknown field(s) {unknown} in a 'send' message; known: {sorted(SEND_KEYS)}. "
            'Sampling options (max_tokens, temperature, ...) go under "sampling"',
            unknown[0],
        )
    check_model(msg.get("model"), state.model_id, state.model_names)
    sampling = msg.get("sampling")
    sampling = {} if sampling is None else sampling  # false or 0 is no object: refused
    if not isinstance(sampling, dict):
        raise BadParam(f"sampling must be an object, got {sampling!r:.40}", "sampling")
    unknown = sorted(set(sampling) - SAMPLING_KEYS)
    if unknown:
        raise BadParam(
            f"unknown sampling option(s) {unknown}; known: {sorted(SAMPLING_KEYS)}", "sampling"
        )
    messages = msg.get("messages")
    kept = live.history if body_flag(msg, "append") else None
    origins: list[str] = []  # per message of the whole history: the field it came from
    if kept is not None:
        if not isinstance(messages, list):
            raise BadParam("messages must be a list of messages", "messages")
        earlier = to_openai_messages(kept)
        origins = [f"history[{i}]" for i in range(len(earlier))]
        origins += [f"messages[{i}]" for i in range(len(messages))]
        messages = earlier + messages
    body = {**sampling, "messages": messages}
    for key in (
        "tools",
        "tool_choice",
        "response_format",
        "continue_final_message",
        "chat_template_kwargs",
    ):
        if key in msg:
            body[key] = msg[key]
    if kept is not None and "tools" not in msg and live.tools:
        body["tools"] = live.tools  # the session goes on as its last finished turn was
    try:
        request = turn_from(body, state.default_max_tokens)
    except InvalidRequestError as e:
        if kept is None:
            raise
        # The checks index the whole history: name the sent messages as the client wrote
        # them, and the kept ones as `history[i]` (the session event's `history`).
        text, param, code = describe_invalid(e)
        param = None if param is None else with_origins(param, origins)
        raise BadParam(with_origins(text, origins), param, code) from None
    request.based_on = kept
    return request


async def _drive(live: LiveSession, run: TurnRun, sender: Watcher) -> None:
    """Run a turn to its end (its events are published by the run itself)."""
    try:
        try:
            await run.start()
        except (InvalidRequestError, TurnCancelled) as e:
            if isinstance(e, TurnCancelled):
                sender.put({"type": "done", "turn": None, "finish_reason": "abort"})
                return
            sender.put(error_json(*describe_invalid(e)))  # the code too (context length)
            sender.put({"type": "done", "turn": None, "finish_reason": "error"})
            return
        async for _ in run.events():
            pass
    except Exception as e:  # noqa: BLE001 - published by the run; the socket goes on
        log.error("session %s: turn failed: %s: %s", live.id, type(e).__name__, e)
        if run.index < 0:
            sender.put(error_json(f"{type(e).__name__}: {e}"))
            sender.put({"type": "done", "turn": None, "finish_reason": "error"})
    finally:
        _free(live, run)


async def _write(ws: WebSocket, watcher: Watcher) -> None:
    try:
        while True:
            event = await watcher.queue.get()
            if event is None:
                await ws.close(code=1013, reason="this socket fell too far behind the session")
                return
            await ws.send_text(json.dumps(event, ensure_ascii=False))
    except (WebSocketDisconnect, RuntimeError, OSError):
        return


async def session_socket(ws: WebSocket) -> None:
    state = ws.app.state.server
    try:
        live = state.hub.get(ws.path_params["session_id"])
    except BadParam as e:
        await ws.close(code=1008, reason=str(e)[:120])
        return
    offered = ws.scope.get("subprotocols", [])
    await ws.accept(subprotocol=PROTOCOL if PROTOCOL in offered else None)
    try:  # before watching: a turn's events must not come between the hello's two events
        hello_memory = memory_json(await asyncio.to_thread(state.service.stats))
    except Exception as e:  # noqa: BLE001 - the engine closed (server shutting down)
        await ws.send_text(json.dumps(error_json(f"the engine is not serving: {e}")))
        await ws.close(code=1011, reason="the engine is not serving")
        return
    watcher = live.watch()
    writer = asyncio.create_task(_write(ws, watcher))
    own: asyncio.Task | None = None  # the turn this socket started
    try:
        watcher.put(
            {
                "type": "session",
                "id": live.id,
                "turns": live.turns,
                "running": live.running is not None,
                "history": to_openai_messages(live.history),
            }
        )
        watcher.put(hello_memory)
        while not writer.done():
            message = await ws.receive()
            if message["type"] == "websocket.disconnect":
                break
            text = message.get("text")
            if text is None:  # a binary frame: read as UTF-8 JSON, refused if it is not
                text = message.get("bytes") or b""
            task = await _handle(text, live, watcher, state)
            if task is not None:
                own = task
    except WebSocketDisconnect:
        pass
    finally:
        live.unwatch(watcher)
        if own is not None and not own.done():
            own.cancel()  # its finally cancels the run: the request is aborted
        writer.cancel()


def _check_idle(live: LiveSession) -> None:
    if live.running is not None:
        raise BadParam(
            f"session {live.id!r} is already running a turn; wait for its 'done' or send "
            "{'type': 'cancel'}",
            "type",
        )


async def _handle(
    text: str | bytes, live: LiveSession, sender: Watcher, state: Any
) -> asyncio.Task | None:
    """One client message (a text frame, or a binary one's bytes); returns the task of a turn
    it started. A large frame's parsing, and a send's checks (its history: the kept one too,
    with `append`), run off the event loop (heavy_work.py), as the HTTP routes' do."""
    limit = state.max_body_bytes
    # Bytes, as the limit says (a character is 1 to 4 of them: count them only when it tells).
    small = isinstance(text, bytes) or 4 * len(text) <= limit
    size = len(text) if small else len(text.encode("utf-8", "replace"))
    if size > limit:
        sender.put(error_json(f"message larger than {limit} bytes", None, "message_too_large"))
        sender.put({"type": "done", "turn": None, "finish_reason": "error"})  # the UI waits
        return None
    kind = None
    try:
        msg = (
            parse_json_body(text, "the message")
            if size <= _INLINE_BYTES  # a cancel, a short send: at once
            else await heavy(parse_json_body, text, "the message")
        )
        if not isinstance(msg, dict):
            raise BadParam("a message must be a JSON object with a 'type'", "type")
        kind = msg.get("type")
        if kind == "cancel":
            if live.running is None:
                raise BadParam("no turn is running in this session", "type")
            live.running.cancel()
            return None
        if kind != "send":
            raise BadParam(f"unknown message type {kind!r}; expected 'send' or 'cancel'", "type")
        _check_idle(live)
        request = await heavy(turn_request, msg, live, state)
        _check_idle(live)  # another socket's send may have started a turn meanwhile
    except Exception as e:  # noqa: BLE001 - a checker's bug too: told, the socket kept
        if isinstance(e, InvalidRequestError):
            message, param, code = describe_invalid(e)
        else:
            log.exception("could not read a session message")
            message, param, code = f"{type(e).__name__}: {e}", None, "server_error"
        sender.put(error_json(message, param, code))
        if kind != "cancel":  # a refused 'send' ends its turn-to-be (the UI waits for a done)
            sender.put({"type": "done", "turn": None, "finish_reason": "error"})
        return None
    run = TurnRun(live, request)
    live.running = run
    task = asyncio.create_task(_drive(live, run, sender))
    # A socket closed at once cancels the task before its first step: `_drive` never runs, so
    # its `finally` does not free the session, which then refused every turn and was never
    # evicted (a leak of one session per such socket). The callback frees it either way.
    task.add_done_callback(lambda _: _free(live, run))
    return task


def _free(live: LiveSession, run: TurnRun) -> None:
    """The turn's task ended (or was cancelled before it began): its run is over."""
    run.cancel()
    if live.running is run:
        live.running = None


routes = [WebSocketRoute("/v1/sessions/{session_id}/ws", session_socket)]
