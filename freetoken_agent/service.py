"""EngineService: one engine shared by many sessions, callers and event loops.

`Engine.stream` drives the engine from the caller's thread: fine for one caller, wrong for a
server with several sessions or for LangChain's async methods. The service owns the engine: a
single background thread steps it while any request is unfinished, and hands each request's
events to that request's sink. Callers submit from any thread (under one lock) and read
their events synchronously (`stream`) or from an asyncio loop (`astream`). Closing a stream
early, or cancelling the task reading it, aborts the request and frees its pages at the next
step; a request that fails ends with an error event and never stops the thread.

Events: the engine keeps every request's events until its owner takes them
(`Engine.take_events`), whoever stepped it. The service takes its requests' events after each
step and whenever it gets the lock back, never from step()'s return value: a caller that steps
the engine under `service.lock` (`engine.generate`, `score`, `Engine.stream`) then leaves the
service's events where the service finds them, and takes only its own. Each event reaches its
owner once; every way a request ends (finished, failed, aborted, the service or the engine
closed) ends its sink with exactly one final event, after which the sink is dropped.

Aborts never wait for the lock (the event loop must not stall for a whole step): `abort`
queues the request and applies the queue at once if the lock is free, else the engine thread
applies it right after the step it is running, before it lets the lock go. A stream aborts
only its own submission (the sink it registered), never a later request reusing its id.

One engine has at most one live service (two would each step the other's requests and drop
their events): integrations share it through `service_for`.

It quacks like the engine where sessions need it (`tokenizer`, `spec`, `stats`, `stream`), so
`Session(service)` works unchanged. Everything else is on `service.engine`, to be touched only
under `service.lock`.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from freetoken_agent.engine.outputs import EngineClosedError, TokenEvent
from freetoken_agent.engine.sampling_params import SamplingParams

log = logging.getLogger("freetoken.service")
IDLE_POLL_S = 0.5  # an idle engine's memory safe point (elastic memory follows free VRAM)
MAX_FAILURES = 20  # failures in a row of the engine thread's own work before it gives up
Sink = Callable[[TokenEvent], Any]

_services_lock = threading.RLock()
_services: weakref.WeakKeyDictionary[Any, EngineService] = weakref.WeakKeyDictionary()


def shared_service(engine: Any) -> tuple[EngineService, bool]:
    """The engine's live EngineService, made now if it has none (a service is returned as is),
    and whether the caller holds it: a holder calls `release()` once done, and a service made
    here closes when its last holder releases it (two MCP hosts or a host and a server on one
    engine: the first to close closed the other's service under it). A service its own maker
    made (`EngineService(engine)`), or one passed in, is held by nobody: its maker closes it."""
    if isinstance(engine, EngineService):
        return engine, False
    with _services_lock:
        live = _services.get(engine)
        if live is not None:
            if live._holders is None:  # made by hand: its maker's to close
                return live, False
            live._holders += 1
            return live, True
        made = EngineService(engine)
        made._holders = 1
        return made, True


@atexit.register
def _close_at_exit() -> None:
    """At interpreter exit, stop every live service between two steps. Its thread is a daemon
    (it must not keep a finished program alive), and a daemon thread still inside a torch op
    when the interpreter tears down aborts the process: "terminate called without an active
    exception", exit code 134, for any script that ends while a request is generating."""
    with _services_lock:
        live = list(_services.values())
    for service in live:
        service.close()


def service_for(engine: Any) -> EngineService:
    """The one EngineService of `engine` (made on first use); a service is returned as is.
    The caller holds it for the program's life (it never releases it)."""
    return shared_service(engine)[0]


class EngineService:
    def __init__(self, engine: Any) -> None:
        with _services_lock:
            if engine in _services:
                raise RuntimeError(
                    "this engine already has a live EngineService: a second one would step the "
                    "first one's requests and drop their events. Share it (service_for(engine)) "
                    "or close it first"
                )
            _services[engine] = self
        self.engine = engine
        # Guards every call into the engine: the engine's own lock, which its front-ends
        # (generate, stream, score) take step by step, so a caller using the engine directly
        # takes turns with this service's thread instead of stepping beside it
        self.lock = getattr(engine, "lock", None) or threading.RLock()
        self._sinks: dict[str, Sink] = {}  # request id -> callable(event) delivering it
        self._aborts: deque[tuple[str, Sink | None]] = deque()  # applied under the lock
        self._work = threading.Condition(self.lock)
        self._closed: str | None = None  # why submit is refused
        self._holders: int | None = None  # shared_service's holders (None: made by hand)
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
            self._apply_aborts()  # what the caller asked before is done in what it reads
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
    def submit(self, prompt, sampling: SamplingParams | None, sink: Sink, **options) -> str:
        """Queue a request whose events go to `sink(event)` (called under the lock, on the
        engine thread or an aborting one; a sink that raises aborts its request). Bad input
        raises here, in the caller's thread. `options` go to Engine.submit."""
        with self.lock:
            if self._closed is not None:
                raise EngineClosedError(self._closed)
            self._apply_aborts()  # an aborted request still holding the id makes room
            rid = self.engine.submit(prompt, sampling, **options)
            self._sinks[rid] = sink
            self._work.notify()
        return rid

    def abort(self, request_id: str, sink: Sink | None = None) -> None:
        """End the request: its sink gets the abort event (or its real last one if it had
        finished). Never waits for the lock (see the module's docstring). With `sink`, only
        the submission that registered that sink is aborted."""
        self._aborts.append((request_id, sink))
        if self.lock.acquire(blocking=False):
            try:
                self._apply_aborts()
            finally:
                self.lock.release()

    def stream(
        self, prompt, sampling: SamplingParams | None = None, **options
    ) -> Iterator[TokenEvent]:
        """This request's events, read in the calling thread. Closing early aborts it."""
        events: queue.SimpleQueue[TokenEvent] = queue.SimpleQueue()
        sink = events.put
        rid = self.submit(prompt, sampling, sink, **options)
        try:
            while True:
                event = events.get()
                yield event
                if event.finished:
                    return
        finally:
            self.abort(rid, sink)  # a no-op once it finished (its sink is gone)

    async def astream(
        self, prompt, sampling: SamplingParams | None = None, **options
    ) -> AsyncIterator[TokenEvent]:
        """This request's events on the running asyncio loop. Cancelling the reader (a client
        that went away) aborts the request. The submission waits for the lock in a worker
        thread, so the loop never stalls behind a step."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[TokenEvent] = asyncio.Queue()

        def deliver(event: TokenEvent) -> None:
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody reads this any more
                loop.call_soon_threadsafe(events.put_nowait, event)

        submitting = asyncio.ensure_future(
            asyncio.to_thread(self.submit, prompt, sampling, deliver, **options)
        )
        try:
            rid = await asyncio.shield(submitting)
        except asyncio.CancelledError:  # the thread submits anyway: abort what it submits
            submitting.add_done_callback(lambda done: self._abort_submitted(done, deliver))
            raise
        try:
            while True:
                event = await events.get()
                yield event
                if event.finished:
                    return
        finally:
            self.abort(rid, deliver)

    def _abort_submitted(self, submitting: asyncio.Future, sink: Sink) -> None:
        if not submitting.cancelled() and submitting.exception() is None:
            self.abort(submitting.result(), sink)

    # --- under the lock -------------------------------------------------------------------
    def _apply_aborts(self) -> None:
        while self._aborts:
            rid, sink = self._aborts.popleft()
            registered = self._sinks.get(rid)
            if registered is None or (sink is not None and registered is not sink):
                continue  # finished already, or the id is another submission's now
            self.engine.abort(rid)  # a no-op if it finished in a step nobody delivered yet
            self._deliver(rid)
            if rid in self._sinks:  # an engine that ends an abort without an event
                self._end(rid, TokenEvent(rid, None, "", 0, True, "abort", None))

    def _deliver_all(self) -> None:
        for rid in list(self._sinks):
            self._deliver(rid)

    def _deliver(self, rid: str) -> None:
        """Hand the request's waiting events to its sink; drop it after the final one."""
        for event in self.engine.take_events(rid):
            sink = self._sinks.get(rid)
            if sink is None:
                return
            if event.finished:
                self._end(rid, event)
                return
            if not self._call(sink, event):
                self._drop(rid)
                return

    def _end(self, rid: str, event: TokenEvent) -> None:
        """End the request with `event`, whatever the engine still had for it. The sink goes
        first (one that aborts its own request meanwhile gets no second end), the tables
        after (a sink may read the request's figures)."""
        sink = self._sinks.pop(rid, None)
        if sink is not None:
            self._call(sink, event)
        self._drop(rid)

    def _drop(self, rid: str) -> None:
        self._sinks.pop(rid, None)
        try:
            self.engine.release(rid)  # a failed sink's request stops; a finished one is dropped
        except Exception:  # noqa: BLE001 - its reader has its end: the thread goes on
            log.exception("releasing request %s failed", rid)

    def _call(self, sink: Sink, event: TokenEvent) -> bool:
        """Deliver one event; False if the sink raised (logged: it fails its request only)."""
        try:
            sink(event)
        except BaseException:  # noqa: BLE001 - one reader's bug (even a KeyboardInterrupt or
            # SystemExit it raised) must not end the engine thread: every later request would
            # wait for it forever
            log.exception("the sink of request %s failed; aborting it", event.request_id)
            return False
        return True

    # --- the engine thread ----------------------------------------------------------------
    def _loop(self) -> None:
        failures = 0  # in a row
        while True:
            try:
                if not self._turn():
                    return
                failures = 0
            except Exception as e:  # noqa: BLE001 - a dead thread would leave every reader hanging
                failures += 1
                log.exception("the engine thread's bookkeeping failed")
                why = f"{type(e).__name__}: {e}"
                with self.lock:
                    self._end_readers(why)
                    if failures >= MAX_FAILURES:  # the engine is broken: say so and stop
                        self._closed = f"the engine failed {failures} times in a row: {why}"
                        return
                time.sleep(0.1)  # no busy loop while the failure repeats
            time.sleep(0)  # let a thread waiting for the lock (a new request) take it

    def _end_readers(self, why: str) -> None:
        """End every reader with an error event, touching the engine only to release each
        request (`_drop`, guarded): its bookkeeping has just failed and may fail again."""
        for rid in list(self._sinks):
            self._end(rid, TokenEvent(rid, None, "", 0, True, "error", why))

    def _turn(self) -> bool:
        """One round of the engine thread: wait for work, step, deliver; False once closed."""
        with self.lock:
            self._deliver_all()  # what a caller stepping under the lock left for us
            self._apply_aborts()
            while self._running() and not self.engine.has_unfinished():
                # Idle: wake now and then so elastic memory follows other programs.
                if not self._work.wait(timeout=IDLE_POLL_S):
                    self._poll_memory()
                self._deliver_all()
                self._apply_aborts()
            if not self._running():
                return False
            try:
                self.engine.step()
            except Exception as e:  # noqa: BLE001 - the engine survives; its requests end
                if not getattr(self.engine, "closed", False):
                    log.exception("engine step failed")
                    self._fail_all(f"{type(e).__name__}: {e}")
            self._deliver_all()
            self._apply_aborts()  # last: an abort asked during the step is done on release
        return True

    @property
    def closed(self) -> bool:
        """Whether the service takes no more requests (it, or its engine, was closed)."""
        return self.why_closed is not None

    @property
    def why_closed(self) -> str | None:
        """Why the service takes no more requests (None while it does)."""
        if self._closed is None and getattr(self.engine, "closed", False):
            return "the engine was closed (Engine.close)"
        return self._closed

    def _running(self) -> bool:
        """False once the service is closed; a closed engine (Engine.close under the lock)
        closes the service here: every reader ends, naming the close."""
        if self._closed is None and getattr(self.engine, "closed", False):
            log.warning("the engine is closed: its EngineService ends every request and stops")
            self._shut("the engine was closed (Engine.close); load the model again to use it")
        return self._closed is None

    def _poll_memory(self) -> None:
        poll = getattr(self.engine, "poll_memory", None)
        if poll is None or getattr(self.engine, "closed", False):  # the loop stops next
            return
        try:
            poll()
        except Exception:  # noqa: BLE001 - a failed poll must not stop the engine thread
            log.exception("memory poll failed")

    def _fail_all(self, message: str) -> None:
        self._deliver_all()  # what the step finished before it failed
        for rid in list(self._sinks):
            self._fail_in_engine(rid, message)
            self._end(rid, TokenEvent(rid, None, "", 0, True, "error", message))

    def _fail_in_engine(self, rid: str, message: str) -> None:
        """The engine's own record of a request a failed step ended: an error, as its stats
        and /metrics count it (the abort `_drop` would make of it counts it as the client's)."""
        req = getattr(self.engine, "_requests", {}).get(rid)
        outcomes = getattr(self.engine, "outcomes", None)
        if req is None or outcomes is None or req.finish_reason is not None:
            return
        try:
            outcomes.fail_request(req, message)
        except Exception:  # noqa: BLE001 - the abort after it still ends the request
            log.exception("recording the failure of request %s failed", rid)

    def _shut(self, why: str) -> None:
        """Refuse new requests and end every reader: with its own last events where the
        engine has them (a closed engine's aborts carry the close), else an abort naming
        `why` (a reader tells it from a cancel: the Anthropic and Responses routes fail it)."""
        self._closed = why
        with _services_lock:
            if _services.get(self.engine) is self:
                del _services[self.engine]
        self._deliver_all()
        for rid in list(self._sinks):
            self._end(rid, TokenEvent(rid, None, "", 0, True, "abort", why))
        self._work.notify()

    def release(self) -> None:
        """A holder is done with the service (shared_service): the last one closes it."""
        with _services_lock:
            if self._holders is None or self._holders <= 0:
                return
            self._holders -= 1
            last = self._holders == 0
            if last and _services.get(self.engine) is self:
                del _services[self.engine]  # no new holder finds it while it closes
        if last:
            self.close()

    def close(self) -> None:
        """Abort every request and stop the thread."""
        with self.lock:
            if self._closed is None:
                self._apply_aborts()
                self._shut("the engine service is closed")
        if threading.current_thread() is not self._thread:
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
