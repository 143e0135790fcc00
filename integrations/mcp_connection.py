"""One MCP server as the host sees it: connect, list tools, call them, survive its failures.

Each connection lives in its own asyncio task (the owner), which enters the SDK's `Client` and
waits until it is told to close. Why a task per server: the SDK's transports open anyio task
groups inside `Client.__aenter__`; entered from the host's own task, a transport fault would
cancel the host (the whole agent loop) through that task group's cancel scope, and the clients
would have to be closed in exact reverse order from the very task that opened them. Owned by
their own tasks, servers start concurrently, fail alone and close in any order; tool calls are
plain requests sent from the caller's task.

Failures never raise out of `call`: a server that exits mid-call (the SDK reports "Connection
closed"), a call past its timeout, a protocol error or a broken server all come back as an
error `CallOutcome` whose text says what happened (with the tail of the server's stderr when it
exited), because the agent loop feeds them to the model as error tool results. A server that
exited is restarted on its next call, at most `MAX_RESTARTS` times. A JSON-RPC error the server
answers itself is the tool's failure, passed on with its message and no restart, even when its
code is one the SDK uses for its own timeout or lost connection.

The owner also watches its server between calls (`mcp_transport.py`): a server that exits while
idle is marked broken at once, so its next call restarts it and then runs; a call the server
never received (the connection closed before the request was written) is sent once more on the
restarted server. A server that exits during a call is reported as such and the call is not
repeated: the tool may have done part of its work. When the server announces a new tool list
(notifications/tools/list_changed), the owner lists the tools again; every listing (a restart's
too) bumps `tools_generation`, which the host's tool index compares.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any, TextIO

import httpx2
import mcp_types as types
from mcp import Client, StdioServerParameters
from mcp.client.sse import sse_client
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import MCP_SESSION_ID, streamable_http_client
from mcp.shared._httpx_utils import (
    MCP_DEFAULT_SSE_READ_TIMEOUT,
    MCP_DEFAULT_TIMEOUT,
    create_mcp_http_client,
)
from mcp.shared.exceptions import MCPError

try:  # the 2026-07-28 protocol's subscriptions (mcp 2.x releases that speak it)
    from mcp.client.subscriptions import ListenNotSupportedError
except ImportError:  # pragma: no cover - an mcp release without them: notifications only
    ListenNotSupportedError = None

from freetoken_agent.integrations.mcp_config import ServerConfig
from freetoken_agent.integrations.mcp_stderr import CapturedStderr
from freetoken_agent.integrations.mcp_transport import tracking, watched

log = logging.getLogger("freetoken.mcp")

MAX_RESTARTS = 3
_GRACE = 5.0  # our own deadline past the SDK's per-call timeout, in case that one never fires
_PROBE_TIMEOUT = 5.0  # a live server answers tools/list at once; one that cannot is gone

SamplingCallback = Callable[[Any, types.CreateMessageRequestParams], Awaitable[Any]]


class MCPServerError(RuntimeError):
    """A server could not be started or listed; the message names it and says why."""


@dataclass(slots=True)
class CallOutcome:
    """What one tool call produced, as text for the model."""

    text: str
    is_error: bool


class ServerConnection:
    def __init__(
        self,
        config: ServerConfig,
        *,
        sampling_callback: SamplingCallback | None = None,
        errlog: TextIO | None = None,
        client_info: types.Implementation | None = None,
    ) -> None:
        self.config = config
        self.name = config.name
        self.tools: list[types.Tool] = []
        self.tools_generation = 0  # bumped by every listing of `tools`
        self.restarts = 0  # in all
        self._restarts_in_a_row = 0  # since a call last came back: MAX_RESTARTS bounds it
        self._sampling = sampling_callback
        self._errlog = errlog  # None: capture each process's stderr to quote it in errors
        self._captured: CapturedStderr | None = None
        self._client_info = client_info
        self._client: Client | None = None
        self._owner: asyncio.Task | None = None
        self._stop: asyncio.Event | None = None
        self._wake = asyncio.Event()  # the owner has something to do: stop, closed, relist
        self._relist = False  # the server said its tool list changed; not yet listed again
        self._listed = asyncio.Event()  # set while no relist is pending
        self._listed.set()
        self._broken: str | None = None  # why the running connection stopped working
        self._session_lost = False  # an HTTP server answered 404 to our session id
        self._http_refusal: str | None = None  # the last error status an HTTP server answered
        # One restart at a time: calls that find the server gone together restart it once
        # (each would otherwise end the process the one before it had just started).
        self._restarting = asyncio.Lock()

    # --- life cycle -----------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self._client is not None and self._broken is None

    async def start(self) -> None:
        """Connect and list the tools, within `startup_timeout`; MCPServerError if not."""
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = loop.create_future()
        self._stop = asyncio.Event()
        self._wake = asyncio.Event()
        self._broken = None
        self._session_lost = False
        self._http_refusal = None
        self._owner = asyncio.create_task(self._own(ready), name=f"mcp-server-{self.name}")
        try:
            await asyncio.wait_for(asyncio.shield(ready), self.config.startup_timeout)
        except asyncio.TimeoutError:
            await self._end_owner()
            raise MCPServerError(
                f"MCP server {self.name!r} did not start within {self.config.startup_timeout:g} s"
                f"{self._stderr_note()}"
            ) from None
        except Exception as e:
            await self._end_owner()
            raise MCPServerError(
                f"MCP server {self.name!r} failed to start: {_describe(e)}"
                f"{self._http_note()}{self._stderr_note()}"
            ) from None

    async def _own(self, ready: asyncio.Future[None]) -> None:
        """The owner task: open the client, publish it, serve until `close` or the server's
        exit, close it."""
        stop, wake = self._stop, self._wake  # this owner's: a restart makes new ones
        assert stop is not None
        try:
            async with AsyncExitStack() as stack:
                client = Client(
                    watched(await self._target(stack), lambda: self._transport_closed(stop)),
                    sampling_callback=self._sampling,
                    message_handler=self._on_message,
                    mode=self.config.protocol,
                    client_info=self._client_info,
                    # No response cache: the host lists tools only when they may have changed,
                    # and then it needs the server's answer, not a remembered one.
                    cache=None,
                )
                await stack.enter_async_context(client)
                self._set_tools(await _list_tools(client))
                await self._listen(client, stack)
                self._client = client
                ready.set_result(None)
                await self._serve(client, stop, wake)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - a transport fault ends this server only
            if not ready.done():
                ready.set_exception(e if isinstance(e, Exception) else RuntimeError(repr(e)))
            else:
                log.debug("MCP server %r closed with %s", self.name, _describe(e))
        finally:
            self._client = None
            self._relist = False
            self._listed.set()  # nobody waits for a listing this owner will not make

    async def _serve(self, client: Client, stop: asyncio.Event, wake: asyncio.Event) -> None:
        """Until told to stop or the server is gone: list the tools again when it says they
        changed (several notifications in a row give one listing)."""
        while True:
            await wake.wait()
            wake.clear()
            if stop.is_set() or self._broken is not None:
                return  # closing the client reaps an exited server's process now
            if self._relist:
                self._relist = False
                try:
                    tools = await asyncio.wait_for(_list_tools(client), self.config.timeout)
                except Exception as e:  # noqa: BLE001 - keep the old list; a call will tell
                    log.warning(
                        "MCP server %r: listing its changed tools failed: %s",
                        self.name,
                        _describe(e),
                    )
                else:
                    self._set_tools(tools)
                if not self._relist:
                    self._listed.set()

    async def _listen(self, client: Client, stack: AsyncExitStack) -> None:
        """Under the 2026-07-28 protocol (`protocol` "auto" or that version) a server tells a
        changed tool list only on a `subscriptions/listen` stream the client opened, not
        unasked as before: open one where the server offers list changes, for the
        connection's life, and read it (each event: list again). An older protocol refuses
        it (ListenNotSupportedError): its notifications come unasked (`_on_message`). A
        version given as is skips the discovery that reads the server's capabilities (none
        are known then): the subscription is tried."""
        if ListenNotSupportedError is None:
            return
        caps = client.server_capabilities
        tools = caps.tools if caps is not None else None
        offered = tools.list_changed if tools is not None else None  # None: not known
        if offered is False:
            return  # the server said it tells no changes
        try:
            sub = await stack.enter_async_context(client.listen(tools_list_changed=True))
        except ListenNotSupportedError:
            return
        except Exception as e:  # noqa: BLE001 - the tools work without it
            level = logging.WARNING if offered else logging.DEBUG  # promised, or only tried
            log.log(level, "MCP server %r: could not subscribe to its tool list changes (%s); "
                    "a new tool is seen after a restart", self.name, _describe(e))  # fmt: skip
            return
        reader = asyncio.create_task(self._read_changes(sub), name=f"mcp-listen-{self.name}")
        stack.callback(reader.cancel)

    async def _read_changes(self, subscription: Any) -> None:
        try:
            async for _ in subscription:
                self._tools_changed()
        except Exception as e:  # noqa: BLE001 - the stream dropped: notifications may go on
            log.debug("MCP server %r: its change stream ended: %s", self.name, _describe(e))

    def _tools_changed(self) -> None:
        """List the tools again before the next turn (several changes: one listing)."""
        self._relist = True
        self._listed.clear()
        self._wake.set()

    def _set_tools(self, tools: list[types.Tool]) -> None:
        self.tools = tools
        self.tools_generation += 1

    async def _on_message(self, message: Any) -> None:
        """The client's message handler: server notifications and transport faults."""
        if getattr(message, "method", None) == "notifications/tools/list_changed":
            self._tools_changed()

    def _transport_closed(self, stop: asyncio.Event) -> None:
        """The read stream ended: the server is gone (a stdio server exited). Called from the
        SDK's receive loop before it fails pending requests, so no call finds the connection
        closed while `running` still says True."""
        if stop is not self._stop or stop.is_set():
            return  # a connection being closed (or an old one) ends as it should
        self._broken = self._broken or "it exited"
        self._wake.set()

    async def tools_settled(self) -> None:
        """Return once a tool list the server announced as changed has been listed (or the
        listing failed, or the server is gone)."""
        try:
            await asyncio.wait_for(self._listed.wait(), self.config.timeout + _GRACE)
        except asyncio.TimeoutError:
            log.warning("MCP server %r: its changed tool list was not listed in time", self.name)

    async def _target(self, stack: AsyncExitStack) -> Any:
        c = self.config
        if c.command is not None:
            params = StdioServerParameters(command=c.command, args=c.args, env=c.env, cwd=c.cwd)
            errlog = self._errlog
            if errlog is None:  # one file for the connection's life: restarts append to it
                if self._captured is None:  # closed in close()
                    self._captured = CapturedStderr()
                errlog = self._captured.file
            return stdio_client(params, errlog=errlog)
        # The read timeout covers one call's reply (the SDK's default, 300 s, would cut a
        # longer `timeout` short); connecting and writing keep the SDK's 30 s.
        read = max(MCP_DEFAULT_SSE_READ_TIMEOUT, c.timeout + _GRACE)
        if c.transport == "sse":
            return sse_client(
                c.url, headers=c.headers or None, timeout=MCP_DEFAULT_TIMEOUT,
                sse_read_timeout=read,
            )  # fmt: skip
        timeout = httpx2.Timeout(MCP_DEFAULT_TIMEOUT, read=read)
        http = await stack.enter_async_context(
            create_mcp_http_client(headers=c.headers or None, timeout=timeout)
        )
        http.event_hooks["response"].append(self._on_http_response)
        return streamable_http_client(c.url, http_client=http)

    async def _on_http_response(self, response: httpx2.Response) -> None:
        """A 404 to a request that carried our session id: the server no longer knows the
        session (it restarted, or expired it). The spec has the client start a new one; the
        SDK reports it only as the call's INVALID_REQUEST error, which a tool may answer too."""
        if response.status_code == 404 and MCP_SESSION_ID in response.request.headers:
            self._session_lost = True
        elif response.status_code >= 400:  # the SDK says only "an error response": keep it
            self._http_refusal = f"{response.status_code} {response.reason_phrase}".strip()

    def _http_note(self) -> str:
        if self._http_refusal is None:
            return ""
        hint = (
            ": check the credentials in its headers"
            if self._http_refusal[:3] in ("401", "403")
            else ""
        )
        return f" (the server answered HTTP {self._http_refusal}{hint})"

    async def close(self) -> None:
        await self._end_owner()
        if self._captured is not None:
            self._captured.close()
            self._captured = None

    async def _end_owner(self) -> None:
        owner, self._owner = self._owner, None
        if owner is None:
            return
        if self._stop is not None:
            self._stop.set()
        self._wake.set()
        # A connected client closes cleanly (the SDK closes stdin, waits for the process, then
        # terminates it: seconds at worst); one still starting is cancelled at once.
        done = set()
        if self._client is not None:
            done, _ = await asyncio.wait({owner}, timeout=10)
        if not done:
            owner.cancel()
            # wait(), not `await owner`: the owner's CancelledError is not ours to raise.
            await asyncio.wait({owner}, timeout=10)
        self._client = None

    # --- calls ----------------------------------------------------------------------------
    async def call(self, tool: str, arguments: dict[str, Any]) -> CallOutcome:
        """Call `tool` on this server; every failure becomes an error outcome. A call that meets
        a closed connection before its request was written restarts the server and is sent
        once more: the server never saw it, so it cannot run twice."""
        if self._captured is not None:
            self._captured.bound()
        outcome = await self._attempt(tool, arguments)
        if outcome is None:
            outcome = await self._attempt(tool, arguments)
        if outcome is None:  # the restarted server was gone again before the call went out
            return CallOutcome(
                f"MCP server {self.name!r} exited before tool {tool!r} could be sent"
                f"{self._stderr_note()}",
                True,
            )
        return outcome

    async def _attempt(self, tool: str, arguments: dict[str, Any]) -> CallOutcome | None:
        """One try of `call`; None when the connection had closed before the request went
        out."""
        if not self.running:  # exited while idle (see `_transport_closed`), or never restarted
            async with self._restarting:
                problem = None if self.running else await self._restart()
            if problem is not None:
                return CallOutcome(problem, True)
        client = self._client
        assert client is not None
        timeout = self.config.timeout
        start = time.monotonic()
        try:
            with tracking() as attempt:
                result = await asyncio.wait_for(
                    client.call_tool(tool, arguments, read_timeout_seconds=timeout),
                    timeout + _GRACE,
                )
        except asyncio.TimeoutError:
            return await self._after_timeout(client, tool)
        except MCPError as e:
            if self._session_lost and e.code == types.INVALID_REQUEST:
                # Refused before it ran (no session): sent again on a new session.
                self._broken = self._broken or "its HTTP session was lost (404)"
                return None
            # The SDK raises its own timeout and lost connection as MCPError with the codes
            # REQUEST_TIMEOUT (-32001) and CONNECTION_CLOSED (-32000), the very codes a server
            # may answer with itself (-32000 is JSON-RPC's generic "server error", "record 42
            # not found"). Its timeout cannot fire before `timeout`; its connection error
            # leaves a session that answers nothing more. Anything else is the server's.
            if e.code == types.REQUEST_TIMEOUT and time.monotonic() - start >= timeout:
                return await self._after_timeout(client, tool)
            if e.code == types.CONNECTION_CLOSED and not attempt.sent:
                # The SDK refused to write it: the server had gone before the call.
                self._broken = self._broken or "it exited"
                return None
            if e.code == types.CONNECTION_CLOSED and not await _answers(client):
                self._broken = "it exited during a call"
                return CallOutcome(
                    f"MCP server {self.name!r} exited while running tool {tool!r}"
                    f"{self._stderr_note()}",
                    True,
                )
            return CallOutcome(f"tool {tool!r} failed: {e.message or _describe(e)}", True)
        except Exception as e:  # noqa: BLE001 - a malformed reply must not end the agent loop
            return CallOutcome(f"tool {tool!r} failed: {_describe(e)}", True)
        self._restarts_in_a_row = 0  # the server works: the budget is for restarts in a row
        return result_outcome(result)

    async def _restart(self) -> str | None:
        """Reconnect a server that exited; the error text when that is impossible. At most
        MAX_RESTARTS in a row: a call the server answers resets the count, so a long session
        survives occasional crashes while a server that fails on every start is given up."""
        why = self._broken or "it is not connected"
        if self._restarts_in_a_row >= MAX_RESTARTS:
            return (
                f"MCP server {self.name!r} is not running ({why}; restarted {MAX_RESTARTS}x "
                "in a row)"
            )
        self.restarts += 1
        self._restarts_in_a_row += 1
        log.warning("restarting MCP server %r (%s)", self.name, why)
        await self._end_owner()
        try:
            await self.start()
        except MCPServerError as e:
            self._broken = str(e)
            return f"MCP server {self.name!r} is not running and could not be restarted: {e}"
        return None

    async def _after_timeout(self, client: Client, tool: str) -> CallOutcome:
        """A call that timed out. A server that answers nothing more either (its event loop
        blocked by the tool, a deadlock) is restarted by the next call, which would otherwise
        wait out the whole timeout again, and every call after it."""
        note = ""
        if not await _answers(client, min(_PROBE_TIMEOUT, self.config.timeout)):
            self._broken = self._broken or "it stopped answering (a call timed out, then a probe)"
            note = "; the server answers nothing more: the next call restarts it"
        return CallOutcome(self._timed_out(tool) + note, True)

    def _timed_out(self, tool: str) -> str:
        return (
            f"tool {tool!r} on MCP server {self.name!r} timed out after "
            f"{self.config.timeout:g} s and was abandoned"
        )

    def _stderr_note(self) -> str:
        tail = self.stderr_tail()
        return f"; its stderr ended with:\n{tail}" if tail else ""

    def stderr_tail(self) -> str:
        """The last lines the server wrote to stderr (when the host captures it)."""
        return "" if self._captured is None else self._captured.tail()


def result_outcome(result: types.CallToolResult) -> CallOutcome:
    """A CallToolResult as text. The engine reads text only: other content is named with a
    placeholder rather than dropped without a word."""
    parts = [_content_text(block) for block in result.content]
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content, ensure_ascii=False))
    text = "\n".join(parts)
    if result.is_error and not text:
        text = "the tool reported an error without a message"
    return CallOutcome(text, bool(result.is_error))


def _content_text(block: Any) -> str:
    kind = getattr(block, "type", None)
    if kind == "text":
        return block.text
    if kind == "resource":
        res = block.resource
        text = getattr(res, "text", None)
        return text if text is not None else f"[binary resource {res.uri} omitted: text only]"
    if kind == "resource_link":
        return f"[resource link: {block.uri}{' ' + block.name if block.name else ''}]"
    mime = getattr(block, "mime_type", None)
    return f"[{kind} content{' (' + mime + ')' if mime else ''} omitted: this model reads text]"


async def _answers(client: Client, timeout: float = _PROBE_TIMEOUT) -> bool:
    """Whether the server still answers a request within `timeout`; any reply counts, an error
    one too. A closed session fails at once, without a round trip. tools/list rather than
    ping: ping is gone from the 2026 protocol, and the cache must be bypassed to reach the
    server."""
    try:
        await asyncio.wait_for(client.list_tools(cache_mode="bypass"), timeout)
    except MCPError as e:
        return e.code != types.CONNECTION_CLOSED
    except Exception:  # noqa: BLE001 - a broken transport or no answer: it is gone
        return False
    return True


async def _list_tools(client: Client) -> list[types.Tool]:
    """Every page of the server's tools; none for a server without tools/list (a resources-
    or prompts-only server declares no tools capability and answers "method not found")."""
    tools: list[types.Tool] = []
    cursor = None
    for _ in range(100):  # a server whose cursor never ends must not hang the start
        try:
            page = await client.list_tools(cursor=cursor, cache_mode="bypass")
        except MCPError as e:
            if e.code == types.METHOD_NOT_FOUND and cursor is None:
                return []
            raise
        tools += page.tools
        cursor = page.next_cursor
        if not cursor:
            break
    return tools


def _describe(error: BaseException) -> str:
    """The innermost cause of an (exception-group wrapped) error, as one line."""
    while getattr(error, "exceptions", None):
        error = error.exceptions[0]  # type: ignore[attr-defined]
    if isinstance(error, MCPError):
        return error.message or repr(error)
    text = str(error) or repr(error)
    return f"{type(error).__name__}: {text}" if type(error).__name__ not in text else text
