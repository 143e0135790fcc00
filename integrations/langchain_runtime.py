"""The plumbing under ChatFreeToken: shared engines, warm Sessions, deadlines and cancellation.

- One EngineService per engine (`service_for`, from service.py, and `load_service`): several
  ChatFreeToken instances, threads and event loops share an engine, and only a service may
  step it.
- A `SessionPool` per ChatFreeToken keeps one Session per binding (tools + tool_choice, or a
  structured-output schema) warm between the calls of an agent loop, so each call only renders
  and diffs its new messages. A call borrows a Session for its duration (Sessions are not
  thread-safe); a concurrent call on the same binding gets another one.
- `Gateway` is what a Session sees as its engine: the service, plus the current call's deadline
  (`timeout`) and cancellation (a cancelled asyncio task). Both abort the engine request at once.
- A `ChoiceGroup` ties the calls of one generation's choices (`n`, langchain_choices.py): it
  tells when the first one's prompt is cached, and cancels them all together.
- Constrained turns (a forced tool call, JSON-schema output) are assembled from the parts in
  langchain_constrained.py and constrained_output.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from langchain_core.exceptions import (
    ContextOverflowError,
    ModelAPIError,
    ModelInvalidRequestError,
    ModelTimeoutError,
)

from freetoken_agent.chat_format import ChatFormat, Prompt
from freetoken_agent.engine.outputs import ContextLengthError, InvalidRequestError
from freetoken_agent.engine.sampling_params import SamplingParams, SamplingParamsError
from freetoken_agent.integrations.constrained_output import (
    HERMES_CLOSE,
    HERMES_OPEN,
    JsonOrCallParser,
)
from freetoken_agent.integrations.langchain_constrained import (
    THINK_END,
    ForcedFormat,
    OpenedReasoning,
    PrefedParser,
)
from freetoken_agent.integrations.one_call import FirstCallOnly
from freetoken_agent.integrations.reasoned_json import writes_call_block
from freetoken_agent.parsers import (
    OutputParser,
    engine_tool_format,
    opens_think_block,
    parser_factory_for,
)
from freetoken_agent.service import EngineService, ServiceView
from freetoken_agent.service import service_for as service_for  # re-exported
from freetoken_agent.session import Session

_STOP = object()  # queued by a cancel: the reader stops waiting for engine events

_lock = threading.Lock()
_loaded: dict[tuple, EngineService] = {}  # engines loaded from a path live for the process
_formats: weakref.WeakKeyDictionary[Any, dict] = weakref.WeakKeyDictionary()


class ContextOverflow(ContextLengthError, ContextOverflowError):
    """The history does not fit the model's context: langchain-core's ContextOverflowError
    (SummarizationMiddleware trims the history on it; retry middleware does not retry it),
    still the engine's ContextLengthError."""


class InvalidModelRequest(InvalidRequestError, ModelInvalidRequestError):
    """A request the engine or the call's checks refuse: langchain-core's
    ModelInvalidRequestError (not retried), still a ValueError."""


@contextlib.contextmanager
def typed_errors() -> Iterator[None]:
    """Refusals re-raised as langchain-core's typed model errors (ContextOverflow,
    InvalidModelRequest), keeping their message, attributes and original base classes."""
    try:
        yield
    except (ContextOverflowError, ModelInvalidRequestError):
        raise
    except ContextLengthError as e:
        raise _retyped(e, ContextOverflow) from e
    except (InvalidRequestError, SamplingParamsError) as e:
        raise _retyped(e, InvalidModelRequest) from e


@contextlib.contextmanager
def request_problems() -> Iterator[None]:
    """A call's preparation (its options, tools, schema, choices, history): a ValueError there
    is a problem of the request (a bad option's type, an unknown option, a response_format of
    no known type), raised as InvalidRequestError so that typed_errors gives it langchain-core's
    ModelInvalidRequestError, which retry middleware does not retry (a plain ValueError it
    retries, with backoff, for an answer that cannot change)."""
    try:
        yield
    except InvalidRequestError:
        raise
    except ValueError as e:
        raise InvalidRequestError(str(e)) from e


def _retyped(error: Exception, kind: type[Exception]) -> Exception:
    out = kind(str(error))
    out.__dict__.update(getattr(error, "__dict__", {}))
    return out


class GenerationError(RuntimeError, ModelAPIError):
    """The engine ended a generation with finish reason "error"; the message is the engine's.
    A langchain-core ModelAPIError, as agent middleware (ModelRetryMiddleware) expects."""


class GenerationTimeout(TimeoutError, ModelTimeoutError):
    """`timeout` seconds passed before the generation finished; the request was aborted."""


def load_service(
    model: str | None, device: str, policy: str, gpu_budget: int | None, options: dict
) -> EngineService:
    """Load (once per process and settings) the model at `model`; None or "demo" is the
    embedded demo model."""
    from freetoken_agent.engine.engine import Engine

    if model in (None, "demo"):
        from freetoken_agent.demo_model import ensure_demo_model

        path = ensure_demo_model()
    else:
        path = Path(model).expanduser()
        if not path.is_dir():
            raise ValueError(f"model {model!r} is not a model folder (or 'demo')")
    key = (str(path.resolve()), device, policy, gpu_budget, tuple(sorted(options.items())))
    with _lock:
        service = _loaded.get(key)
        if service is None or service.closed:  # a closed one would refuse every request
            engine = Engine.load(
                path, device=device, gpu_budget=gpu_budget, policy=policy, progress=False,
                **options,
            )  # fmt: skip
            service = _loaded[key] = EngineService(engine)
        return service


def chat_format(service: EngineService, thinking: bool | None) -> ChatFormat:
    """One ChatFormat per (engine, enable_thinking): its render cache is shared by every
    Session on that engine."""
    with _lock:
        per = _formats.setdefault(service, {})
        if thinking not in per:
            extra = {} if thinking is None else {"enable_thinking": thinking}
            per[thinking] = ChatFormat(service.tokenizer, **extra)
        return per[thinking]


# ------------------------------------------------------------------------ calls and gateway


class ChoiceGroup:
    """The calls of one generation's choices: `first` is set at the first engine event any of
    them reads (the prompt is cached by then), or by `cancel`, which cancels every call of the
    group, made already or later, and keeps the first error that ended a choice."""

    def __init__(self) -> None:
        self.first = threading.Event()
        self.error: BaseException | None = None
        self.cancelled = False
        self._calls: list[Call] = []
        self._lock = threading.Lock()

    def track(self, call: Call) -> None:
        with self._lock:
            self._calls.append(call)
            cancelled = self.cancelled
        if cancelled:
            call.cancel()

    def fail(self, error: BaseException) -> None:
        """A choice ended with `error`: keep it (unless an earlier one is kept) and cancel."""
        with self._lock:
            if self.error is None and not self.cancelled:
                self.error = error
        self.cancel()

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True
            calls = list(self._calls)
        for call in calls:
            call.cancel()
        self.first.set()  # nobody waits for a first event that may not come


class Call:
    """One generation's deadline and cancellation, shared by its reader and its canceller."""

    def __init__(
        self, service: EngineService, timeout: float | None, group: ChoiceGroup | None = None
    ) -> None:
        self.service = service
        self.timeout = timeout
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.events: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.sink = self.events.put  # what the service knows this call's request by
        self.request_id: str | None = None
        self.cancelled = False
        self.group = group
        if group is not None:
            group.track(self)

    def started(self, request_id: str) -> bool:
        """Record the engine request; False if the call was cancelled before it existed."""
        with self.lock:
            self.request_id = request_id
            return not self.cancelled

    def cancel(self) -> None:
        """Abort the engine request (from any thread, the event loop's included: it never
        waits for the engine's lock) and wake the reader: with the request's final event,
        which the service delivers, or before the request exists with _STOP."""
        with self.lock:
            if self.cancelled:
                return
            self.cancelled = True
            rid = self.request_id
        if rid is not None:
            self.service.abort(rid, self.sink)
        else:
            self.events.put(_STOP)

    def next_event(self) -> Any:
        if self.deadline is None:
            event = self.events.get()
        else:
            try:
                event = self.events.get(timeout=max(0.0, self.deadline - time.monotonic()))
            except queue.Empty:
                raise GenerationTimeout(
                    f"the generation did not finish within timeout={self.timeout}s; it was aborted"
                ) from None
        if self.group is not None:
            self.group.first.set()
        return event


class Gateway(ServiceView):
    """A Session's engine: the shared service, read through the current call's deadline."""

    def __init__(self, service: EngineService) -> None:
        super().__init__(service)
        self.call: Call | None = None

    def stream(
        self, prompt: Sequence[int], sampling: SamplingParams | None = None, **options
    ) -> Iterator:
        call = self.call or Call(self.service, None)
        rid = self.service.submit(prompt, sampling, call.sink, **options)
        try:
            if not call.started(rid):
                return
            while True:
                event = call.next_event()
                if event is _STOP:
                    return
                yield event
                if event.finished:
                    return
        finally:
            # A no-op once finished (a later request given the same id is not this one's);
            # frees the request otherwise.
            self.service.abort(rid, call.sink)


@dataclass(frozen=True, slots=True)
class Binding:
    """What a Session is built for. mode: auto | none | required (a forced call of one of
    `allowed`) | json (output constrained to `schema`) | json_or_call (that or a call)."""

    key: str  # canonical JSON of everything below, for the pool
    tools: tuple[dict, ...] | None
    mode: str
    allowed: tuple[str, ...] = ()
    schema: dict | None = None
    # where the answer begins with reasoning (modes json, json_or_call and required): the
    # model reasons, then the grammar holds the JSON to the schema (reasoned_json.py)
    reasoned: bool = False
    # the template's enable_thinking for this call (the model's `reasoning` as the call reads
    # it: a pooled Session keeps the rendering it was built with, so it is part of the key)
    thinking: bool | None = None


def build_session(service: EngineService, binding: Binding) -> Session:
    gateway = Gateway(service)
    thinking = binding.thinking
    tools = list(binding.tools) if binding.tools else None
    if binding.mode in ("auto", "none"):
        fmt = chat_format(service, thinking)
        if tools and binding.mode == "auto":
            factory = parser_factory_for(gateway, tools)
        else:

            def factory(prompt: Prompt) -> OutputParser:
                return OutputParser(None, opens_think_block(prompt, service.tokenizer), None)

        return Session(gateway, tools=tools, chat_format=fmt, parser_factory=factory)
    if binding.reasoned:  # reasoning, then the JSON: the think block stays open
        opened = OpenedReasoning(chat_format(service, thinking))

        def reasoned(prompt: Prompt) -> OutputParser | JsonOrCallParser:
            if binding.mode in ("json_or_call", "required"):  # the call's (or answer's) JSON
                # (a forced call's in the Hermes block the grammar writes, for such models)
                block = writes_call_block(binding.mode == "required", service)
                return JsonOrCallParser(True, tools or [], in_block=block)
            return OutputParser(None, True, None)

        return Session(gateway, tools=tools, chat_format=opened, parser_factory=reasoned)
    # Constrained: the grammar starts at the first generated token, so no thinking.
    forced_call = binding.mode == "required"
    native = forced_call and engine_tool_format(service) == "hermes"
    forced = ForcedFormat(chat_format(service, False), HERMES_OPEN if native else "")

    def constrained(prompt: Prompt) -> PrefedParser:
        head = THINK_END if forced.opened else ""
        if binding.mode == "json_or_call":
            return PrefedParser(JsonOrCallParser(forced.opened, tools), head, "")
        if not forced_call:
            return PrefedParser(OutputParser(None, forced.opened, None), head, "")
        # The grammar writes {"name": ..., "arguments": ...}: the Hermes form's body whatever
        # the model's own format, so a Hermes parser reads it (the opener replayed if the
        # prompt did not carry it).
        return PrefedParser(
            OutputParser("hermes", forced.opened, tools), head + HERMES_OPEN, HERMES_CLOSE
        )

    return Session(gateway, tools=tools, chat_format=forced, parser_factory=constrained)


class SessionPool:
    """Warm Sessions of one ChatFreeToken, by binding; a borrowed Session is used by one call."""

    MAX_BINDINGS = 32  # a new structured-output schema per call would otherwise grow it
    MAX_IDLE = 4  # per binding

    def __init__(self, service: EngineService) -> None:
        self.service = service
        self._idle: OrderedDict[str, list[Session]] = OrderedDict()
        self._lock = threading.Lock()
        self.last: Session | None = None  # the Session of the last finished call

    def acquire(self, binding: Binding) -> Session:
        with self._lock:
            idle = self._idle.get(binding.key)
            if idle:
                return idle.pop()
        return build_session(self.service, binding)

    def release(self, binding: Binding, session: Session) -> None:
        with self._lock:
            self.last = session
            idle = self._idle.setdefault(binding.key, [])
            self._idle.move_to_end(binding.key)
            if len(idle) < self.MAX_IDLE:
                idle.append(session)
            while len(self._idle) > self.MAX_BINDINGS:
                self._idle.popitem(last=False)


# ------------------------------------------------------------------------------- running


def run_turn(
    pool: SessionPool,
    binding: Binding,
    history: list,
    sampling: SamplingParams,
    timeout,
    one_call: bool = False,
    continue_final: bool = False,
    group: ChoiceGroup | None = None,
) -> Iterator[Any]:
    """Session events of one turn, read in the calling thread. Closing early aborts.
    `one_call` (parallel_tool_calls=False): the engine request stops at the first complete
    tool call, and nothing after it is passed on (FirstCallOnly). `continue_final`: the model
    goes on from the last message, the assistant's. `group`: the choices' group the turn's
    call belongs to."""
    session = pool.acquire(binding)
    gateway: Gateway = session.engine
    call = gateway.call = Call(pool.service, timeout, group)
    first = FirstCallOnly(call.cancel) if one_call else None
    events = session.send(history, sampling, continue_final=continue_final)
    try:
        for event in events:
            if first is None or (event := first(event)) is not None:
                yield event
    finally:
        events.close()
        gateway.call = None
        pool.release(binding, session)


async def arun_turn(
    pool: SessionPool,
    binding: Binding,
    history: list,
    sampling: SamplingParams,
    timeout,
    one_call: bool = False,
    continue_final: bool = False,
    group: ChoiceGroup | None = None,
) -> AsyncIterator[Any]:
    """The same on an asyncio loop. The Session is synchronous, so it runs in a thread whose
    events come through a queue; cancelling the reading task aborts the engine request at once
    (before the cancellation propagates), not when the thread notices."""
    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
    session = pool.acquire(binding)
    gateway: Gateway = session.engine
    call = gateway.call = Call(pool.service, timeout, group)
    first = FirstCallOnly(call.cancel) if one_call else None

    def post(kind: str, item: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody reads any more
            loop.call_soon_threadsafe(inbox.put_nowait, (kind, item))

    def work() -> None:
        try:
            for event in session.send(history, sampling, continue_final=continue_final):
                post("event", event)
            post("done", None)
        except BaseException as e:  # noqa: BLE001 - handed to the reader, raised there
            post("error", e)
        finally:
            gateway.call = None
            pool.release(binding, session)

    threading.Thread(target=work, name="freetoken-langchain-turn", daemon=True).start()
    done = False
    try:
        while True:
            kind, item = await inbox.get()
            if kind == "done":
                done = True
                return
            if kind == "error":
                done = True
                raise item
            if first is None or (item := first(item)) is not None:
                yield item
    finally:
        if not done:
            call.cancel()
