"""MCPHost: the local model as an MCP host, running an agent loop over MCP servers' tools.

    async with MCPHost.from_config("mcp_servers.json", engine=engine, max_tokens=256) as host:
        result = await host.run("List the files and summarise README.md", max_steps=8)
        print(result.answer)
        async for event in host.stream(result.messages + [UserMessage("and then?")]): ...

Entering the host starts every configured server at once (`mcp_connection.py`: one owner task
each). A server that fails to start is logged, listed in `host.failures` and skipped; the host
runs with the others. Tools are offered to the model as OpenAI-style function dicts under their
own names, or as `server__tool` where two servers offer the same name (`mcp_tools.py`). A
server's tool list may change while the host runs (it announces a change, or it was restarted):
the host takes the new lists at the next turn boundary, never in the middle of a turn.

A run is the agent loop: one Session turn with the tools; each tool call the model makes is
executed on its server through `session.arun_tool`, so the session's tool hooks apply, and its
result (errors flagged `is_error`) is appended as a tool message; then the next turn, until the
model answers without calling a tool or `max_steps` turns were taken. Calls of one turn run one
after another, in the order the model wrote them: a model that writes a file and then reads it
back in one turn means that order. Unknown tools, servers that crash or time out, and invalid
arguments all come back to the model as error results; none of them ends the run. A tool
result (or error) longer than `max_result_tokens` is cut to that, the cut marked in its text,
so one result cannot overflow the context. Should the history still outgrow the context (many
results, a long run), the engine refuses the next turn: the run ends with stop_reason "error"
and an error that says so, with the history as it stands (trim it, then run on).

`tool_choice` (first turn only, as in OpenAI's Agents SDK: forcing every turn would loop until
`max_steps`): "auto" (the default), "none" (the tools stay in the prompt, as the server's "none"
keeps them, but nothing is read as a call: the turn is the answer), "required" (some tool), a
tool name or OpenAI's `{"type": "function", "function": {"name": ...}}`, to which FreeToken adds
an optional `"arguments": {...}` that pins those argument values. A forced turn is generated under a
JSON-schema grammar (`engine/constrained.py`) of `{"name", "arguments"}` objects, so even a weak
model makes a well-formed call if it ends within max_tokens (one cut short ends the run with
stop_reason "error", saying so); the JSON is parsed here instead of by the model's tool-call
parser, as vLLM does for a named tool_choice.

Servers' sampling requests are answered by the same model (`mcp_sampling.py`). Runs are
serialised (one Session per host keeps the rendered history for prefix reuse); use several
hosts for parallel conversations on one EngineService.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import aclosing
from pathlib import Path
from typing import Any, TextIO

import mcp_types as types

from freetoken_agent.chat_format import ChatFormat
from freetoken_agent.engine.outputs import ContextLengthError, InvalidRequestError
from freetoken_agent.hooks import ToolHooks
from freetoken_agent.integrations.mcp_config import ServerConfig, load_config
from freetoken_agent.integrations.mcp_connection import MCPServerError, ServerConnection
from freetoken_agent.integrations.mcp_engine import as_service
from freetoken_agent.integrations.mcp_model_turn import forced_schema, stream_turn
from freetoken_agent.integrations.mcp_sampling import SamplingResponder
from freetoken_agent.integrations.mcp_tools import Route, ToolIndex
from freetoken_agent.integrations.mcp_turn import (
    RunResult,
    StepStart,
    ToolExecuted,
    Turn,
    cap_result,
    openai_tool,
)
from freetoken_agent.messages import (
    MESSAGE_TYPES,
    Message,
    ToolCall,
    ToolResult,
    UserMessage,
    coerce_messages,
)
from freetoken_agent.parsers import parser_factory_for
from freetoken_agent.session import Session, Usage

log = logging.getLogger("freetoken.mcp")


class MCPHost:
    def __init__(
        self,
        servers: Sequence[ServerConfig],
        *,
        engine: Any,
        system: str | None = None,
        hooks: ToolHooks | None = None,
        errlog: TextIO | None = None,
        model_name: str | None = None,
        sampling_max_tokens: int = 1024,
        max_result_tokens: int | None = None,
        **sampling_defaults: Any,
    ) -> None:
        """`engine`: an Engine (wrapped in an EngineService owned by the host) or a shared
        EngineService. `sampling_defaults` (max_tokens, temperature, ...) apply to the host's
        turns and, where a server's request leaves them open, to sampling. `errlog`: where
        stdio servers' stderr goes (default: captured, quoted in error messages).
        `max_result_tokens`: the most a tool result puts into the history (default: a quarter
        of the context, at most 25,000)."""
        names = [s.name for s in servers]
        if len(set(names)) != len(names):
            raise ValueError(f"MCP server names must be unique, got {names}")
        if max_result_tokens is not None and max_result_tokens < 1:
            raise ValueError(f"max_result_tokens must be positive, got {max_result_tokens}")
        self.configs = list(servers)
        self.engine = engine
        self.system = system
        self.hooks = hooks or ToolHooks()
        self.errlog = errlog
        self.model_name = model_name or f"freetoken/{engine.spec.arch}"
        self.sampling_max_tokens = sampling_max_tokens
        self.max_result_tokens = max_result_tokens
        self.sampling_defaults = dict(sampling_defaults)
        self.connections: dict[str, ServerConnection] = {}
        self.failures: dict[str, str] = {}  # server name -> why it did not start
        self.tools: list[dict[str, Any]] = []  # OpenAI-style, as the prompt shows them
        self.routes: dict[str, Route] = {}
        self._index = ToolIndex()
        self.session: Session | None = None
        self.sampler: SamplingResponder | None = None
        self._service: Any = None
        self._owns_service = False
        self._lock = asyncio.Lock()

    @classmethod
    def from_config(
        cls, config: str | Path | Mapping[str, Any], *, engine: Any, **options: Any
    ) -> MCPHost:
        """A host for the servers of a Cursor-style config (file path or dict)."""
        return cls(load_config(config), engine=engine, **options)

    # --- life cycle -----------------------------------------------------------------------
    async def __aenter__(self) -> MCPHost:
        try:
            await self._start()
        except BaseException:
            await self.aclose()  # servers already started must not outlive a failed enter
            raise
        return self

    async def _start(self) -> None:
        # Entered again: a fresh index (the last one's listing counts would match the new
        # connections', and route calls to the closed ones).
        self._index = ToolIndex()
        self.tools, self.routes, self.failures = [], {}, {}
        self._service, self._owns_service = as_service(self.engine)
        if self.max_result_tokens is None:
            # A quarter of the context: one result leaves room for the system prompt, the tool
            # list, the conversation and the answer, and a few of one turn still fit. 25,000
            # tokens (Claude Code's cap on MCP output) is more than a model can use at once.
            context = getattr(self._service.engine, "max_model_len", None) or 100_000
            self.max_result_tokens = max(1, min(25_000, context // 4))
        chat_format = ChatFormat(self._service.tokenizer)
        self.sampler = SamplingResponder(
            self._service,
            chat_format,
            model_name=self.model_name,
            max_tokens_cap=self.sampling_max_tokens,
            defaults=self.sampling_defaults,
        )
        candidates = [
            ServerConnection(
                c,
                sampling_callback=self.sampler.callback_for(c.name),
                errlog=self.errlog,
                client_info=types.Implementation(name="freetoken-mcp-host", version="0.1.0"),
            )
            for c in self.configs
        ]
        self.connections = {c.name: c for c in candidates}  # so aclose() reaches them all
        outcomes = await asyncio.gather(*(c.start() for c in candidates), return_exceptions=True)
        for conn, outcome in zip(candidates, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                why = str(outcome) if isinstance(outcome, MCPServerError) else repr(outcome)
                self.failures[conn.name] = why
                log.warning("skipping MCP server %r: %s", conn.name, why)
                await self.connections.pop(conn.name).close()
        self.session = Session(
            self._service,
            system=self.system,
            chat_format=chat_format,
            parser_factory=parser_factory_for(self._service),
            hooks=self.hooks,
            **self.sampling_defaults,
        )
        self._reindex()  # the servers' tools, when there are any

    def _check_entered(self) -> None:
        """Runs and calls need the host entered and not yet closed: after the exit its
        connections are closed, and a call would start a server nothing stops."""
        if self.session is None or self._service is None:
            raise RuntimeError("enter the host first: `async with MCPHost(...) as host`")

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await asyncio.gather(*(c.close() for c in self.connections.values()))
        self.connections.clear()
        if self._owns_service and self._service is not None:
            self._service.release()  # closed by its last holder (shared_service)
        self._service = None

    # --- the tool index -------------------------------------------------------------------
    async def _refresh_tools(self) -> None:
        """At a turn boundary: take the servers' current tool lists, once the listings they
        announced have arrived."""
        await asyncio.gather(*(c.tools_settled() for c in self.connections.values()))
        self._reindex()

    def _reindex(self) -> None:
        """Rebuild routes, tools and the session's tool list and parser when a server's list
        changed since the last build. The tool list is part of the rendered prompt (in the
        system turn), so a change makes the next prompt diverge from the last one there: the
        KV after that point is prefilled again, once. That is the price of the model seeing
        the tools it can call (and not the ones it cannot)."""
        if not self._index.stale(self.connections):
            return
        self._index.build(self.connections.values())
        self.tools, self.routes = self._index.tools, self._index.routes
        if self.session is not None:
            self.session.tools = list(self.tools) or None
            self.session.parser_factory = parser_factory_for(self._service, self.tools or None)

    # --- the agent loop -------------------------------------------------------------------
    async def run(
        self,
        messages: str | Message | Sequence[Message | Mapping[str, Any]],
        *,
        max_steps: int = 8,
        tool_choice: str | Mapping[str, Any] = "auto",
        sampling: Mapping[str, Any] | None = None,
    ) -> RunResult:
        """Run the loop to its end; see `stream` for the arguments."""
        result = None
        async for event in self.stream(
            messages, max_steps=max_steps, tool_choice=tool_choice, sampling=sampling
        ):
            result = event
        assert isinstance(result, RunResult)
        return result

    async def stream(
        self,
        messages: str | Message | Sequence[Message | Mapping[str, Any]],
        *,
        max_steps: int = 8,
        tool_choice: str | Mapping[str, Any] = "auto",
        sampling: Mapping[str, Any] | None = None,
    ) -> AsyncIterator[Any]:
        """The loop's events: StepStart, the parser's events (ReasoningDelta, ContentDelta,
        ToolCallStart/ArgsDelta/End, ParseWarning), Usage per turn, ToolExecuted per call,
        and last a RunResult. `messages`: a user message or a whole history; `tool_choice`
        applies to the first turn; `sampling` overrides the host's options for this run."""
        self._check_entered()
        if not isinstance(max_steps, int) or max_steps < 1:
            raise ValueError(f"max_steps must be a positive integer, got {max_steps!r}")
        # Bad arguments raise here, before anything runs.
        history = coerce_messages(_as_history(messages))
        self.session.sampling(dict(sampling or {}))
        async with self._lock:  # a run in progress keeps its tool index to the turn's end
            await self._refresh_tools()
            forced = forced_schema(tool_choice, self.tools, self.routes)  # the tools the model sees
            first = self._first_turn_parser(tool_choice)
            loop = self._loop(history, max_steps, forced, dict(sampling or {}), first)
            async with aclosing(loop) as events:
                async for event in events:
                    yield event

    async def _loop(
        self,
        history: list[Message],
        max_steps: int,
        forced: tuple[str, dict[str, Any]] | None,
        sampling: dict[str, Any],
        first_parser: Any = None,
    ) -> AsyncIterator[Any]:
        """`first_parser`: the first turn's parser factory where it is not the session's."""
        usages: list[Usage] = []
        step = 0
        while step < max_steps:
            if step:  # a turn boundary: tool lists that changed during the last calls apply
                await self._refresh_tools()
            yield StepStart(step, forced[0] if forced else None)
            turn = Turn()
            try:
                parser = first_parser if step == 0 else None
                turn_events = stream_turn(self.session, history, sampling, forced, turn, parser)
                async with aclosing(turn_events) as events:
                    async for event in events:
                        yield event
            except ContextLengthError as e:  # say what outgrew it, not just the engine's no
                error = (
                    f"the conversation no longer fits the model's context ({e}); tool results "
                    f"are cut to {self.max_result_tokens} tokens each (max_result_tokens): "
                    "shorten the history or start a new run"
                )
                yield RunResult(history, "", step, "error", usages, error)
                return
            except InvalidRequestError as e:
                yield RunResult(history, "", step, "error", usages, str(e))
                return
            was_forced, forced = forced is not None, None
            step += 1
            usages.append(turn.usage)
            history.append(turn.message())
            if turn.usage.finish_reason == "error":
                error = turn.usage.error or "the generation failed"
                yield RunResult(history, turn.content, step, "error", usages, error)
                return
            if was_forced and not turn.calls:  # its JSON was cut: not an answer
                error = turn.void or "the forced tool call is void"
                yield RunResult(history, turn.content, step, "error", usages, error)
                return
            if not turn.calls:
                yield RunResult(history, turn.content, step, "answer", usages)
                return
            for call in turn.calls:  # routed by the names the model saw in this turn
                executed = await self._execute(call)
                history.append(executed.result)
                yield executed
        yield RunResult(history, "", step, "max_steps", usages)

    def _first_turn_parser(self, tool_choice: Any) -> Any:
        """tool_choice "none": a parser that reads no calls (the model may still write one; it
        stays text, and the turn is the answer). Else None: the session's own."""
        if tool_choice == "none":
            return parser_factory_for(self._service, calls=False)
        return None

    async def execute(self, call: ToolCall) -> ToolExecuted:
        """Run one call as the loop does: routed by name, through the session's hooks, every
        failure (unknown tool, server crash, timeout) an error result. For callers that run
        tools themselves (a UI, a test). Outside a run it is a turn boundary: tool lists that
        changed apply first."""
        self._check_entered()
        if not self._lock.locked():
            await self._refresh_tools()
        return await self._execute(call)

    async def _execute(self, call: ToolCall) -> ToolExecuted:
        session = self.session
        assert session is not None
        start = time.perf_counter()
        route = self.routes.get(call.name)

        async def fn(**arguments: Any) -> ToolResult:
            if route is None:
                available = ", ".join(self.routes) or "none"
                text = f"unknown tool {call.name!r}; the available tools are: {available}"
                return ToolResult(call.id, self._cap(text), is_error=True, name=call.name)
            outcome = await route.connection.call(route.tool, arguments)
            text = self._cap(outcome.text)
            return ToolResult(call.id, text, is_error=outcome.is_error, name=call.name)

        result = await session.arun_tool(call, fn)
        server = route.connection.name if route else None
        return ToolExecuted(call, server, result, time.perf_counter() - start)

    def _cap(self, text: str) -> str:
        limit = self.max_result_tokens
        assert limit is not None and self._service is not None
        return cap_result(text, limit, self._service.tokenizer.encode)


def _as_history(messages: Any) -> list[Any]:
    if isinstance(messages, str):
        return [UserMessage(messages)]
    if isinstance(messages, (*MESSAGE_TYPES, Mapping)):
        return [messages]
    return list(messages)


__all__ = ["MCPHost", "RunResult", "StepStart", "ToolExecuted", "openai_tool"]
