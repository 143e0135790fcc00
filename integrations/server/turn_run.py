"""TurnRun: one turn of a LiveSession, run in a worker thread and read on the event loop.

    run = TurnRun(live, request)
    await run.start()              # rendered and submitted; bad input raises here (-> 400)
    async for event in run.events(): ...   # parser events, then the Session's Usage
    run.cancel()                   # any time: aborts the request, frees its pages

`Session.send` blocks (it renders, then waits on each token), so it runs in a thread of its
own; events cross to the loop through an asyncio queue. `start` returns as soon as the engine
has accepted the request, so every refusal (malformed history, context too long, a schema the
grammar cannot compile) surfaces before a response starts streaming. Every event is also
published, as JSON, to the session's watchers, followed by `memory` and `done`. A task of the
run's own does that (and gathers the reply), not the reader of `events()`: the reader is the
client's task, cancelled when the client leaves, and the watchers must still see the aborted
turn's usage and `done`.

A session runs one turn at a time: the worker holds the session's `turn_lock` for the whole
turn, so a turn queued behind another (two OpenAI requests with one X-Session-Id) waits.
The turn sets what its request says of the session's rendering (tools, enable_thinking) under
that lock. With `parallel_tool_calls: false` its events go through FirstCallOnly (one_call.py),
which cancels the Turn once the first call is complete.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
from collections.abc import AsyncIterator
from typing import Any

from freetoken_agent.continuation import continued_message
from freetoken_agent.engine.outputs import SchemaError, TokenEvent, TokenLogprob
from freetoken_agent.engine.sampling_params import SamplingParams
from freetoken_agent.integrations.one_call import FirstCallOnly
from freetoken_agent.integrations.openai_logprobs import TokenStrings
from freetoken_agent.integrations.server.bridge import Turn, TurnCancelled
from freetoken_agent.integrations.server.chat_request import TurnRequest
from freetoken_agent.integrations.server.errors import BadParam
from freetoken_agent.integrations.server.hub import LiveSession
from freetoken_agent.integrations.server.reply import Reply
from freetoken_agent.integrations.server.session_events import (
    error_json,
    event_json,
    logprob_json,
    memory_json,
    tool_result_json,
)
from freetoken_agent.integrations.server.tool_choice import (
    ParserFactory,
    parser_factory,
    reasoned_answer,
    reasons_before_answer,
    turn_sampling,
)
from freetoken_agent.messages import ToolResult, UserMessage, content_text
from freetoken_agent.session import Usage

log = logging.getLogger("freetoken.server")


@dataclasses.dataclass(slots=True)
class _Started:
    prompt_tokens: int


@dataclasses.dataclass(slots=True)
class _Memory:
    stats: dict


_END = object()
# The longest a worker holds the turn lock for the loop to keep its turn's history (it takes
# a moment; a loop that has closed never does).
KEEP_WAIT_S = 10.0


def put_first_event(loop: asyncio.AbstractEventLoop, event: asyncio.Event) -> None:
    """Set `event` on its loop, from the engine thread (a closed loop: nobody waits)."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(event.set)


def failed_at_once(event: TokenEvent) -> bool:
    """Whether a request's first event is its failure (an engine error before any token)."""
    return event.finished and event.finish_reason == "error"


def turn_format(request: TurnRequest, formats: Any, bridge: Any) -> Any:
    """The ChatFormat a turn renders with (`formats`: the hub's ThinkingFormats): its
    enable_thinking's, but a forced call that comes first (no reasoning before it: no
    thinking budget bounds one, or the template does not reason first) renders with thinking
    off, as ChatFreeToken renders it. Why: the template then writes its own closed think block
    where it has one (Qwen3's `<think>\n\n</think>\n\n`), the form its model answers in
    without thinking, where the server skipped the block (Qwen3 in thinking mode opens one
    first) or closed an opened one itself (`<think>\n</think>\n\n`); and the same request
    gives the same prompt through LangChain and the routes."""
    chat_format = formats.get(request.enable_thinking)
    if not request.tool_choice.forced or request.enable_thinking is False:
        return chat_format
    # (A forced turn takes no strict tools' grammar: its sampling is the request's.)
    reasons = reasons_before_answer(request.tool_choice, request.tools, request.sampling,
                                    chat_format, bridge)  # fmt: skip
    return chat_format if reasons else formats.get(False)


def turn_plan(
    request: TurnRequest, chat_format: Any, bridge: Any, turn: Turn
) -> tuple[SamplingParams, ParserFactory]:
    """The sampling a turn submits (the strict tools' grammar, or the reasoned one holding
    a JSON answer or call after the reasoning) and the Session's parser factory for it, which
    also sets the prompt suffix the turn appends (`turn.suffix_ids`) when called with the
    rendered prompt. Anthropic's count_tokens asks here too, to count that suffix."""
    sampling = turn_sampling(request.tool_choice, request.tools, bridge, request.sampling)
    reasoned = reasoned_answer(
        request.tool_choice,
        request.tools,
        sampling,
        request.call_or_answer,
        chat_format,
        bridge,
    )
    if reasoned is not None:  # the schema after the reasoning, in one grammar
        sampling = dataclasses.replace(
            sampling,
            json_schema=None,
            response_format=None,
            grammar=reasoned,
            grammar_holds_answer=True,
        )
    factory = parser_factory(
        request.tool_choice,
        request.tools,
        bridge,
        turn,
        request.call_or_answer,
        json_answer=request.sampling.json_schema is not None,
        reasoned=reasoned is not None,
    )
    return sampling, factory


class TurnRun:
    def __init__(self, live: LiveSession, request: TurnRequest) -> None:
        self.live = live
        self.request = request
        self.turn = Turn(live.bridge.service)
        self.reply = Reply()
        self.usage: Usage | None = None
        self.prompt_tokens: int | None = None
        self.finished = False
        self.index = -1  # the session's turn number, once started
        self.divergence: dict[str, Any] = {}  # where the prompt left the last one (Session)
        self._strings: TokenStrings | None = None  # token strings of `logprob` events
        self._queue: asyncio.Queue = asyncio.Queue()  # from the worker, to `_publish`
        self._out: asyncio.Queue = asyncio.Queue()  # from `_publish`, to `events()`
        self._thread: threading.Thread | None = None
        self._publisher: asyncio.Task | None = None  # held: the loop keeps tasks weakly
        # Set at the request's first engine event (its prompt is cached by then), or when the
        # run ends without one: choices.py waits for it before starting the other choices,
        # which it does not start when the run failed by then (`failed_early`).
        self.first_event = asyncio.Event()
        self.failed_early = False
        # Set once the loop has recorded the run's end (its history kept), or once nobody
        # will (start() failed or was cancelled): the worker holds the turn lock until then.
        self._kept = threading.Event()

    # --- the worker thread ----------------------------------------------------------------
    def _work(self, loop: asyncio.AbstractEventLoop) -> None:
        def put(item: Any) -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody reads any more
                loop.call_soon_threadsafe(self._queue.put_nowait, item)

        live, turn = self.live, self.turn
        try:
            with live.turn_lock:
                if turn.cancelled:  # while it waited: its client left (serve_choices; start()
                    # has let go), or a `cancel` came before it ran (start() waits: told so)
                    put(TurnCancelled("the turn was cancelled before it started"))
                    return
                request = self.request = self._rebased()
                live.session.tools = request.tools
                live.session.chat_format = turn_format(request, live.formats, live.bridge)
                turn.on_submit = lambda n: put(_Started(n))
                turn.on_first_event = lambda event: self._first(loop, event)
                sampling, factory = turn_plan(request, live.session.chat_format, live.bridge, turn)
                one = None if request.parallel_tool_calls else FirstCallOnly(turn.cancel)
                live.bridge.current = turn  # from here to the `finally` that clears it
                try:
                    for event in live.session.send(
                        request.messages,
                        sampling,
                        parser_factory=factory,
                        continue_final=request.continue_final,
                        shares_prompt=request.shares_prompt,
                    ):
                        if one is not None and (event := one(event)) is None:
                            continue
                        put(self._exact(event) if isinstance(event, Usage) else event)
                finally:
                    live.bridge.current = None
                put(_Memory(live.bridge.stats()))
                put(_END)
                # The lock is held until the loop has kept this turn's history (`_done`): a
                # turn waiting for it reads that history as it starts (`_rebased`).
                self._kept.wait(KEEP_WAIT_S)
        except Exception as e:  # noqa: BLE001 - handed to the loop, which answers the client
            put(e)

    def _rebased(self) -> TurnRequest:
        """The request, an `append` send's messages put after the history kept now (under
        the turn lock) rather than the one kept when it was sent, if a turn ended between."""
        request, kept = self.request, self.live.history
        if request.based_on is None or request.based_on is kept:
            return request
        new = request.messages[len(request.based_on) :]  # one record a message, kept first
        return dataclasses.replace(request, messages=[*kept, *new], based_on=kept)

    def _exact(self, usage: Usage) -> Usage:
        """The Session's Usage with the server's suffix counted and the engine's own figures
        for this request (exact even when other requests finished meanwhile). Also keeps the
        Session's record of where this turn diverged from the last (for the usage event)."""
        stats = self.live.session.turn_stats
        if stats:
            self.divergence = {
                "first_divergence": stats[-1].get("first_divergence"),
                "anchor": stats[-1].get("anchor"),
            }
        usage = dataclasses.replace(
            usage, prompt_tokens=usage.prompt_tokens + len(self.turn.suffix_ids)
        )
        figures = self.turn.figures
        if figures is not None:
            usage = dataclasses.replace(
                usage,
                reused_tokens=figures["reused"],
                prefilled_tokens=figures["prefilled"],
                exact=True,
            )
            stats = self.live.session.turn_stats
            if stats:
                stats[-1].update(
                    reused_tokens=usage.reused_tokens,
                    prefilled_tokens=usage.prefilled_tokens,
                    source="engine",
                )
        return usage

    # --- the event loop -------------------------------------------------------------------
    async def start(self) -> int:
        """Run until the engine accepted the request; returns the prompt's token count."""
        if self._thread is not None:
            raise RuntimeError("TurnRun.start() called twice")
        self._thread = threading.Thread(
            target=self._work,
            args=(asyncio.get_running_loop(),),
            name=f"freetoken-turn-{self.live.id or 'anon'}",
            daemon=True,
        )
        self._thread.start()
        try:
            item = await self._queue.get()
        except BaseException:
            self.cancel()
            self._kept.set()  # no publisher will record the end
            raise
        if isinstance(item, BaseException):
            self.finished = True
            self._stopped_running()
            self._kept.set()
            if isinstance(item, SchemaError):
                # The grammar compiler (engine) refuses a schema without knowing which field
                # of the request it came from: a forced call's is the tools', a call-or-answer
                # schema may be either's (none is named), else it is the response_format's.
                request = self.request
                param = "tools" if request.tool_choice.forced else "response_format"
                param = None if request.call_or_answer else param
                if request.sampling.constraint is None:  # only the strict tools' grammar
                    param = "tools"
                raise BadParam(str(item), param) from item
            raise item
        if not isinstance(item, _Started):  # the worker always announces the submission first
            self.cancel()
            self._kept.set()
            raise RuntimeError(f"turn worker sent {type(item).__name__} before starting")
        self.prompt_tokens = item.prompt_tokens
        # The session's running turn from here to its end, whichever route started it: a
        # socket watching the session sees it running, may cancel it, and an `append` send
        # meanwhile is refused as busy (a WebSocket send is set running before it starts).
        self.live.running = self
        self.index = self.live.turns
        self.live.turns += 1
        self._announce()
        self._publisher = asyncio.create_task(self._publish())
        return item.prompt_tokens

    def _announce(self) -> None:
        live = self.live
        messages = self.request.messages
        if self.request.continue_final:  # the question came before the message it goes on with
            messages = messages[:-1]
        user = next((m for m in reversed(messages) if not isinstance(m, ToolResult)), None)
        live.publish(
            {
                "type": "start",
                "turn": self.index,
                "prompt_tokens": self.prompt_tokens,
                # what a watcher shows as the turn's question
                "user": content_text(user.content) if isinstance(user, UserMessage) else None,
            }
        )
        trailing = []
        for msg in reversed(self.request.messages):  # what tools returned since the last reply
            if not isinstance(msg, ToolResult):
                break
            trailing.append(msg)
        for result in reversed(trailing):
            live.publish(tool_result_json(result))

    async def _publish(self) -> None:
        """Gather and publish the worker's items to the end, and pass them on to `events()`."""
        while not self.finished:
            item = await self._queue.get()
            try:
                self._record(item)
            except Exception as e:  # noqa: BLE001 - a bug here must not leave the reader waiting
                log.exception("could not publish a turn's event")
                self.cancel()
                self.finished, item = True, e
                self._stopped_running()
                self._kept.set()
            if not isinstance(item, _Memory):
                self._out.put_nowait(item)

    def _first(self, loop: asyncio.AbstractEventLoop, event: TokenEvent) -> None:
        """On the engine thread: the request's first event (set before the loop is told)."""
        self.failed_early = failed_at_once(event)
        put_first_event(loop, self.first_event)

    def _record(self, item: Any) -> None:
        if item is _END or isinstance(item, BaseException):
            if not self.first_event.is_set():  # ended without a single engine event
                self.failed_early = True
            self.first_event.set()  # ended: nothing waits for an event that will not come
        if item is _END:
            self.finished = True
            self._done()
            self._stopped_running()  # after the history is kept: an append sent now reads it
            self._kept.set()
        elif isinstance(item, BaseException):
            self.finished = True
            self.live.publish(error_json(f"{type(item).__name__}: {item}"))
            self.live.publish({"type": "done", "turn": self.index, "finish_reason": "error"})
            self._stopped_running()
            self._kept.set()
        elif isinstance(item, _Memory):
            self.live.publish(memory_json(item.stats))
        else:
            if isinstance(item, Usage):
                self.usage = item
                if item.error:
                    self.live.publish(error_json(item.error))
            else:
                self.reply.add(item)
            published = (
                logprob_json(item, self._token_strings())
                if isinstance(item, TokenLogprob)
                else event_json(item)
            )
            if published is not None:
                if isinstance(item, Usage):
                    published.update(self.divergence)
                    # The turn's reason, as `done` and the chat route give it (a reply that
                    # ends with calls: tool_calls), not the engine's raw one.
                    published["finish_reason"] = self.finish_reason()
                self.live.publish(published)

    def _token_strings(self) -> TokenStrings:
        if self._strings is None:
            self._strings = TokenStrings(self.live.bridge.service.tokenizer)
        return self._strings

    async def events(self) -> AsyncIterator[Any]:
        """Parser events, then Usage. Raises what the worker raised."""
        while True:
            item = await self._out.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    @property
    def logprobs(self) -> list[TokenLogprob]:
        """Every generated token's log-probabilities so far, when the turn asked for them."""
        return self.reply.logprobs

    @property
    def prompt_logprobs(self) -> list[TokenLogprob | None] | None:
        """The prompt's log-probabilities (vLLM's prompt_logprobs), when the turn asked."""
        return self.turn.prompt_logprobs

    def finish_reason(self) -> str | None:
        reason = self.usage.finish_reason if self.usage is not None else None
        if reason == "stop" and self.reply.calls:
            return "tool_calls"
        return reason

    def _done(self) -> None:
        reason = self.finish_reason()
        reply = self.reply.message()
        if reason == "abort" and (reply.content or reply.reasoning):
            # Interrupted (a cancel, or its socket closed) after writing something: the turn
            # stays, as chat UIs keep a stopped answer, so that an `append` steering it next
            # is read with the question it interrupts (and its KV is reused). Calls it began
            # are dropped: none of them ran. With nothing written the turn leaves no trace.
            reply = dataclasses.replace(reply, tool_calls=[])
            kept = True
        else:
            kept = reason in ("stop", "length", "tool_calls")
        if kept:
            *before, last = self.request.messages
            if self.request.continue_final:  # the last message goes on with the reply
                self.live.history = [*before, continued_message(last, reply)]
            else:
                self.live.history = [*self.request.messages, reply]
            self.live.tools = self.request.tools  # what an `append` send naming none keeps
        message = self.reply.openai_message()
        self.live.publish(
            {"type": "done", "turn": self.index, "finish_reason": reason, "message": message}
        )

    def _stopped_running(self) -> None:
        if self.live.running is self:
            self.live.running = None

    def cancel(self) -> None:
        """Abort the turn's request (a no-op once it has finished)."""
        if not self.finished:
            self.turn.cancel()
