"""EngineService: one engine shared by many sessions, callers and event loops.

`Engine.stream` drives the engine from the caller's thread: fine for one caller, wrong for a
server with several sessions or for LangChain's async methods. The service owns the engine: a
single background thread steps it while any request is unfinished, and hands each request's
events to that request's own queue. Callers submit from any thread (under one lock) and read
their events synchronously (`stream`) or from an asyncio loop (`astream`). Closing a stream
early, or cancelling the task reading it, aborts the request and frees its pages at the next
step; a request that fails ends with an error event and never stops the thread.

It quacks like the engine where sessions need it (`tokenizer`, `spec`, `stats`, `stream`), so
`Session(service)` works unchanged. Everything else is on `service.engine`, to be touched only
under `service.lock`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

from freetoken_agent.engine.outputs import TokenEvent
from freetoken_agent.engine.sampling_params import SamplingParams

log = logging.getLogger("freetoken.service")
IDLE_POLL_S = 0.5  # an idle engine's memory safe point (elastic memory follows free VRAM)


class EngineService:
    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.lock = threading.RLock()  # guards every call into the engine
        self._sinks: dict[str, Any] = {}  # request id -> callable(event) delivering it
        self._work = threading.Condition(self.lock)
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="freetoken-engine", daemon=True)
        self._thread.start()

    # --- what sessions read ---------------------------------------------------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def spec(self):
        return self.engine.spec

    def stats(self) -> dict:
        with self.lock:
            return self.engine.stats()

    def set_gpu_budget(self, nbytes: int) -> dict:
        """Engine.set_gpu_budget under the lock (applied at the engine's next safe point);
        returns the elastic-memory figures. InvalidRequestError when it cannot apply."""
        with self.lock:
            self.engine.set_gpu_budget(nbytes)
            return self.engine.stats()["elastic"]

    def memory_trace(self, last: int) -> dict | None:
        """The last `last` changes of the elastic split (None: memory is not elastic)."""
        with self.lock:
            memory = self.engine.memory
            if memory is None:
                return None
            trace = memory.trace.to_json()
            trace["records"] = trace["records"][-last:]
            return trace

    # --- requests -------------------------------------------------------------------------
    def submit(self, prompt, sampling: SamplingParams | None, sink, **options) -> str:
        """Queue a request whose events go to `sink(event)` (called on the engine thread).
        Bad input raises here, in the caller's thread. `options` go to Engine.submit."""
        with self.lock:
            if self._closed:
                raise RuntimeError("the engine service is closed")
            rid = self.engine.submit(prompt, sampling, **options)
            self._sinks[rid] = sink
            self._work.notify()
        return rid

    def abort(self, request_id: str) -> None:
        with self.lock:
            if self._sinks.pop(request_id, None) is not None:
                self.engine.abort(request_id)
                self.engine._pop(request_id)  # the service reads events from step(), not here

    def stream(
        self, prompt, sampling: SamplingParams | None = None, **options
    ) -> Iterator[TokenEvent]:
        """This request's events, read in the calling thread. Closing early aborts it."""
        events: queue.SimpleQueue[TokenEvent] = queue.SimpleQueue()
        rid = self.submit(prompt, sampling, events.put, **options)
        try:
            while True:
                event = events.get()
                yield event
                if event.finished:
                    return
        finally:
            self.abort(rid)

    async def astream(
        self, prompt, sampling: SamplingParams | None = None, **options
    ) -> AsyncIterator[TokenEvent]:
        """This request's events on the running asyncio loop. Cancelling the reader (a client
        that went away) aborts the request."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[TokenEvent] = asyncio.Queue()

        def deliver(event: TokenEvent) -> None:
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody reads this any more
                loop.call_soon_threadsafe(events.put_nowait, event)

        rid = self.submit(prompt, sampling, deliver, **options)
        try:
            while True:
                event = await events.get()
                yield event
                if event.finished:
                    return
        finally:
            self.abort(rid)

    # --- the engine thread ----------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self.lock:
                while not self._closed and not self.engine.has_unfinished():
                    # Idle: wake now and then so elastic memory follows other programs.
                    if not self._work.wait(timeout=IDLE_POLL_S):
                        self._poll_memory()
                if self._closed:
                    return
                try:
                    events = self.engine.step()
                except Exception as e:  # noqa: BLE001 - the engine survives; its requests end
                    log.exception("engine step failed")
                    events = self._fail_all(f"{type(e).__name__}: {e}")
                for event in events:
                    sink = self._sinks.get(event.request_id)
                    if sink is None:
                        continue
                    sink(event)
                    if event.finished:
                        del self._sinks[event.request_id]
                        self.engine._pop(event.request_id)
            time.sleep(0)  # let a thread waiting for the lock (a new request) take it

    def _poll_memory(self) -> None:
        poll = getattr(self.engine, "poll_memory", None)
        if poll is None:
            return
        try:
            poll()
        except Exception:  # noqa: BLE001 - a failed poll must not stop the engine thread
            log.exception("memory poll failed")

    def _fail_all(self, message: str) -> list[TokenEvent]:
        events = []
        for rid in list(self._sinks):
            self.engine.abort(rid)
            events.append(TokenEvent(rid, None, "", 0, True, "error", message))
        return events

    def close(self) -> None:
        """Abort every request and stop the thread."""
        with self.lock:
            for rid in list(self._sinks):
                self._sinks.pop(rid)(TokenEvent(rid, None, "", 0, True, "abort", None))
                self.engine.abort(rid)
                self.engine._pop(rid)
            self._closed = True
            self._work.notify()
        self._thread.join(timeout=10)

    def __enter__(self) -> EngineService:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ServiceView:
    """What a Session reads from its engine (`tokenizer`, `spec`, `stats`), taken from a shared
    EngineService. Integrations subclass it with their own `stream`, which routes a Session's
    turn through their per-call bookkeeping (deadline, cancellation, the server's turn)."""

    def __init__(self, service: EngineService) -> None:
        self.service = service

    @property
    def tokenizer(self):
        return self.service.tokenizer

    @property
    def spec(self):
        return self.service.spec

    def stats(self) -> dict:
        return self.service.stats()
