"""SessionHub: the server's live Sessions by id, and who is watching each.

A conversation keeps one Session across its turns, so each turn is diffed against what the
last one sent and the anchors it reports stay meaningful. Sessions are kept by id (WebSocket
path, or the `X-Session-Id` header of an OpenAI request), least recently used first out once
there are more than `max_sessions` (never one that is running or watched). A request without an
id gets a fresh Session of its own: the engine's radix tree still reuses the KV of any prefix
it has seen, whichever Session sent it.

Every socket open on a session id is a watcher: each turn's events are published to all of
them, so a web page can follow a session that an agent drives.

All sessions share one ChatFormat (its render cache then serves them all: an agent's sessions
share system prompts and tool lists) and render concurrently, each in its turn's worker thread.
ChatFormat is safe for that: its cache does one lookup per step and never re-reads an entry
another thread may have cleared (test_hub.py hammers it with a cache small enough to be
cleared all the time). No lock, then: a long cold render (a hundred messages, about a second
on two cores) would otherwise hold back every other session's first token. A request's
chat_template_kwargs.enable_thinking picks another shared ChatFormat (`ThinkingFormats`), made
with that template variable as ChatFreeToken's `reasoning` makes its own; the turn sets it as
its Session's format (turn_run.py).
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from freetoken_agent.chat_format import ChatFormat
from freetoken_agent.integrations.server.bridge import EngineBridge
from freetoken_agent.integrations.server.errors import BadParam
from freetoken_agent.messages import Message
from freetoken_agent.service import EngineService
from freetoken_agent.session import Session

if TYPE_CHECKING:
    from freetoken_agent.integrations.server.turn_run import TurnRun

SESSION_ID = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
WATCHER_BACKLOG = 10_000  # events a slow watcher may fall behind before it is dropped


@dataclass(eq=False)
class Watcher:
    """One socket's outbox. `None` in the queue tells its writer to close the socket."""

    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    dropped: bool = False

    def put(self, event: dict | None) -> None:
        if self.dropped:
            return
        if self.queue.qsize() >= WATCHER_BACKLOG:
            self.dropped = True
            event = None  # too far behind: end this watcher rather than hold memory
        self.queue.put_nowait(event)


class ThinkingFormats:
    """The server's ChatFormat for each enable_thinking value (None: the template's default),
    each made on first use and then shared by every session."""

    def __init__(self, default: ChatFormat) -> None:
        self._formats: dict[bool | None, ChatFormat] = {None: default}
        self._lock = threading.Lock()  # turns of several sessions may ask at once

    def get(self, thinking: bool | None) -> ChatFormat:
        with self._lock:
            fmt = self._formats.get(thinking)
            if fmt is None:
                default = self._formats[None]
                fmt = ChatFormat(
                    default.tokenizer,
                    default.template_name,
                    **{**default.template_kwargs, "enable_thinking": thinking},
                )
                self._formats[thinking] = fmt
            return fmt


class LiveSession:
    def __init__(
        self, session_id: str | None, service: EngineService, formats: ThinkingFormats
    ) -> None:
        self.id = session_id
        self.bridge = EngineBridge(service)
        self.formats = formats
        self.session = Session(self.bridge, chat_format=formats.get(None))
        self.turn_lock = threading.Lock()  # held by the worker thread for a whole turn
        self.watchers: set[Watcher] = set()
        self.history: list[Message] = []  # the last finished turn's messages and reply
        self.tools: list[dict] | None = None  # the tools that turn offered
        self.running: TurnRun | None = None
        self.turns = 0
        self.last_used = time.monotonic()

    def publish(self, event: dict[str, Any]) -> None:
        for watcher in list(self.watchers):
            watcher.put(event)

    def watch(self) -> Watcher:
        watcher = Watcher()
        self.watchers.add(watcher)
        return watcher

    def unwatch(self, watcher: Watcher) -> None:
        self.watchers.discard(watcher)

    @property
    def idle(self) -> bool:
        return self.running is None and not self.watchers and not self.turn_lock.locked()


class SessionHub:
    def __init__(
        self, service: EngineService, chat_format: ChatFormat, max_sessions: int = 256
    ) -> None:
        self.service = service
        self.chat_format = chat_format
        self.formats = ThinkingFormats(chat_format)
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, LiveSession] = OrderedDict()

    def get(self, session_id: str) -> LiveSession:
        """The live session of that id, created on first use."""
        if not isinstance(session_id, str) or not SESSION_ID.fullmatch(session_id):
            raise BadParam(
                f"session id {session_id!r:.60} must be 1-128 characters of letters, digits "
                "and _ . : -",
                "session_id",
            )
        live = self._sessions.get(session_id)
        if live is None:
            live = LiveSession(session_id, self.service, self.formats)
            self._sessions[session_id] = live
            self._evict(keep=session_id)
        self._sessions.move_to_end(session_id)
        live.last_used = time.monotonic()
        return live

    def lookup(self, session_id: str | None) -> LiveSession:
        """A kept session for an id, or a fresh unkept one without."""
        if session_id is None:
            return LiveSession(None, self.service, self.formats)
        return self.get(session_id)

    def _evict(self, keep: str) -> None:
        """The least recently used idle sessions out, down to max_sessions if they allow;
        never `keep`, the one just made (idle too until its caller watches or runs it)."""
        over = len(self._sessions) - self.max_sessions
        idle = [sid for sid, live in self._sessions.items() if live.idle and sid != keep]
        for sid in idle[: max(over, 0)]:
            del self._sessions[sid]

    def __len__(self) -> int:
        return len(self._sessions)
