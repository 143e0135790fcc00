"""The plumbing under ChatFreeToken: shared engines, warm Sessions, deadlines and cancellation.

- One EngineService per engine (`service_for`, `load_service`): several ChatFreeToken
  instances, threads and event loops share an engine, and only a service may step it.
- A `SessionPool` per ChatFreeToken keeps one Session per binding (tools + tool_choice, or a
  structured-output schema) warm between the calls of an agent loop, so each call only renders
  and diffs its new messages. A call borrows a Session for its duration (Sessions are not
  thread-safe); a concurrent call on the same binding gets another one.
- `Gateway` is what a Session sees as its engine: the service, plus the current call's deadline
  (`timeout`) and cancellation (a cancelled asyncio task). Both abort the engine request at once.
- Constrained turns (a forced tool call, JSON-schema output) cannot think and must start with
  the tool-call opener: `ForcedFormat` appends it to each rendered prompt, `PrefedParser`
  replays it to the output parser, and the grammar closes the JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import queue
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from langchain_core.utils.json_schema import dereference_refs

from freetoken_agent.chat_format import ChatFormat, Prompt
from freetoken_agent.engine.constrained import tool_call_schema
from freetoken_agent.engine.sampling_params import SamplingParams
from freetoken_agent.parsers import ContentDelta, OutputParser, parser_factory_for, tool_format_for
from freetoken_agent.parsers.reasoning import CLOSE as THINK_CLOSE
from freetoken_agent.parsers.reasoning import prompt_opens_reasoning
from freetoken_agent.service import EngineService
from freetoken_agent.session import Session

HERMES_OPEN = "<tool_call>\n"
HERMES_CLOSE = "\n</tool_call>"
_STOP = object()  # queued by a cancel: the reader stops waiting for engine events

_lock = threading.Lock()
_services: weakref.WeakKeyDictionary[Any, EngineService] = weakref.WeakKeyDictionary()
_loaded: dict[tuple, EngineService] = {}  # engines loaded from a path live for the process
_formats: weakref.WeakKeyDictionary[Any, dict] = weakref.WeakKeyDictionary()


class GenerationError(RuntimeError):
    """The engine ended a generation with finish reason "error"; the message is the engine's."""


class GenerationTimeout(TimeoutError):
    """`timeout` seconds passed before the generation finished; the request was aborted."""


def service_for(engine: Any) -> EngineService:
    """The one EngineService of `engine` (made on first use); a service is returned as is.
    A program that already made a service for an engine must pass that service instead."""
    if isinstance(engine, EngineService):
        return engine
    with _lock:
        service = _services.get(engine)
        if service is None:
            service = _services[engine] = EngineService(engine)
        return service


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
        if service is None:
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


def tool_format(service: EngineService) -> str | None:
    sources = getattr(service.tokenizer, "chat_template_sources", {}) or {}
    return tool_format_for(service.spec.arch, sources.get("tool_use") or sources.get("default"))


# ------------------------------------------------------------------------ calls and gateway


class Call:
    """One generation's deadline and cancellation, shared by its reader and its canceller."""

    def __init__(self, service: EngineService, timeout: float | None) -> None:
        self.service = service
        self.timeout = timeout
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.events: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.request_id: str | None = None
        self.cancelled = False

    def started(self, request_id: str) -> bool:
        """Record the engine request; False if the call was cancelled before it existed."""
        with self.lock:
            self.request_id = request_id
            return not self.cancelled

    def cancel(self) -> None:
        """Abort the engine request now (from any thread) and wake the reader."""
        with self.lock:
            if self.cancelled:
                return
            self.cancelled = True
            rid = self.request_id
        if rid is not None:
            self.service.abort(rid)
        self.events.put(_STOP)

    def next_event(self) -> Any:
        if self.deadline is None:
            return self.events.get()
        try:
            return self.events.get(timeout=max(0.0, self.deadline - time.monotonic()))
        except queue.Empty:
            raise GenerationTimeout(
                f"the generation did not finish within timeout={self.timeout}s; it was aborted"
            ) from None


class Gateway:
    """A Session's engine: the shared service, read through the current call's deadline."""

    def __init__(self, service: EngineService) -> None:
        self.service = service
        self.call: Call | None = None

    @property
    def tokenizer(self):
        return self.service.tokenizer

    @property
    def spec(self):
        return self.service.spec

    def stats(self) -> dict:
        return self.service.stats()

    def stream(self, prompt: Sequence[int], sampling: SamplingParams | None = None) -> Iterator:
        call = self.call or Call(self.service, None)
        rid = self.service.submit(prompt, sampling, call.events.put)
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
            self.service.abort(rid)  # a no-op once finished; frees the request otherwise


# ---------------------------------------------------------------- constrained turns' parts


class ForcedFormat:
    """A ChatFormat whose prompts end with what a constrained turn must start from: the think
    block closed (when the template left it open) and, for a Hermes tool call, `<tool_call>\\n`.
    One per Session: `opened` describes the last rendered prompt for its parser."""

    def __init__(self, inner: ChatFormat, opener: str) -> None:
        self.inner = inner
        self.tokenizer = inner.tokenizer
        self.opener = opener
        self.opened = False  # the inner prompt left a think block open

    def render(self, messages, tools=None, add_generation_prompt: bool = True, **kw) -> Prompt:
        prompt = self.inner.render(messages, tools, add_generation_prompt, **kw)
        self.opened = prompt_opens_reasoning(prompt.text)
        suffix = (THINK_CLOSE + "\n\n" if self.opened else "") + self.opener
        if not suffix:
            return prompt
        ids = self.tokenizer.backend.encode(suffix, add_special_tokens=False).ids
        return Prompt(
            prompt.token_ids + list(ids),
            prompt.text + suffix,
            prompt.anchors,
            prompt.messages,
            prompt.generation_prefix + suffix,
        )


class PrefedParser:
    """An OutputParser that first reads `head` (what the prompt, not the model, wrote: the think
    closer, the call opener) and at the end `tail` (the call closer the grammar stops before),
    the tail only when the body is complete JSON: a body cut by max_tokens stays unterminated,
    and the parser says so, rather than closing it into a misleading JSON error."""

    def __init__(self, inner: Any, head: str, tail: str) -> None:
        self.inner = inner
        self.head = head
        self.tail = tail
        self.body: list[str] = []

    def feed(self, text: str) -> list:
        head, self.head = self.head, ""
        if self.tail:
            self.body.append(text)
        return self.inner.feed(head + text)

    def finish(self) -> list:
        head, self.head = self.head, ""
        tail = self.tail if self.tail and _is_json("".join(self.body)) else ""
        return self.inner.feed(head + tail) + self.inner.finish()


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


class JsonOrCallParser:
    """Output constrained to "the answer's JSON or a {"name", "arguments"} call of a tool" (tools
    and a response_format together, as LangChain agents bind them): only the whole text tells
    which, so content is held until the end, then read as a Hermes call body or released."""

    def __init__(self, opened: bool, tools: list[dict]) -> None:
        self.inner = OutputParser(None, opened, None)
        self.tools = tools
        self.names = {t["function"]["name"] for t in tools}
        self.held: list[str] = []

    def feed(self, text: str) -> list:
        return self._hold(self.inner.feed(text))

    def finish(self) -> list:
        out = self._hold(self.inner.finish())
        text = "".join(self.held)
        try:
            obj = json.loads(text)
        except ValueError:
            obj = None
        is_call = isinstance(obj, dict) and set(obj) == {"name", "arguments"}
        if is_call and obj["name"] in self.names:
            calls = OutputParser("hermes", False, self.tools)
            return out + calls.feed(HERMES_OPEN + text + HERMES_CLOSE) + calls.finish()
        return out + ([ContentDelta(text)] if text else [])

    def _hold(self, events: list) -> list:
        out = []
        for event in events:
            if isinstance(event, ContentDelta):
                self.held.append(event.text)
            else:
                out.append(event)
        return out


def _inline(schema: dict) -> dict:
    """`schema` with its $refs inlined, so it can sit inside a larger schema (anyOf, a call's
    arguments) where "#/$defs/..." would no longer resolve."""
    out = dereference_refs(schema)
    if "$ref" not in json.dumps(out):
        out = {k: v for k, v in out.items() if k not in ("$defs", "definitions")}
    return out


def _closed(node: Any) -> Any:
    """Objects that list their properties get additionalProperties false unless they say
    otherwise (OpenAI's strict mode does the same): otherwise the grammar lets a model append
    keys nobody asked for, and a weak one rambles there until max_tokens."""
    if isinstance(node, list):
        return [_closed(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: _closed(v) for k, v in node.items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def output_schema(mode: str, tools: list[dict], schema: dict | None) -> dict | None:
    """The json_schema that constrains a turn of `mode` (None: unconstrained)."""
    if mode in ("auto", "none"):
        return None
    if mode == "json":
        return _closed(schema)
    calls = [tool_call_schema(_inline_tool(t)) for t in tools]
    if mode == "json_or_call":
        calls.append(_inline(schema))
    return _closed(calls[0] if len(calls) == 1 else {"anyOf": calls})


def _inline_tool(tool: dict) -> dict:
    fn = dict(tool["function"])
    fn["parameters"] = _inline(fn.get("parameters") or {"type": "object", "properties": {}})
    return {"type": "function", "function": fn}


@dataclass(frozen=True, slots=True)
class Binding:
    """What a Session is built for. mode: auto | none | required (a forced call of one of
    `allowed`) | json (output constrained to `schema`) | json_or_call (that or a call)."""

    key: str  # canonical JSON of everything below, for the pool
    tools: tuple[dict, ...] | None
    mode: str
    allowed: tuple[str, ...] = ()
    schema: dict | None = None


def build_session(service: EngineService, binding: Binding, thinking: bool | None) -> Session:
    gateway = Gateway(service)
    tools = list(binding.tools) if binding.tools and binding.mode != "none" else None
    if binding.mode in ("auto", "none"):
        fmt = chat_format(service, thinking)
        if tools:
            factory = parser_factory_for(gateway, tools)
        else:

            def factory(prompt: Prompt) -> OutputParser:
                return OutputParser(None, prompt_opens_reasoning(prompt.text), None)

        return Session(gateway, tools=tools, chat_format=fmt, parser_factory=factory)
    # Constrained: the grammar starts at the first generated token, so no thinking.
    forced_call = binding.mode == "required"
    native = forced_call and tool_format(service) == "hermes"
    forced = ForcedFormat(chat_format(service, False), HERMES_OPEN if native else "")

    def constrained(prompt: Prompt) -> PrefedParser:
        head = THINK_CLOSE + "\n\n" if forced.opened else ""
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

    def __init__(self, service: EngineService, thinking: bool | None) -> None:
        self.service = service
        self.thinking = thinking
        self._idle: OrderedDict[str, list[Session]] = OrderedDict()
        self._lock = threading.Lock()
        self.last: Session | None = None  # the Session of the last finished call

    def acquire(self, binding: Binding) -> Session:
        with self._lock:
            idle = self._idle.get(binding.key)
            if idle:
                return idle.pop()
        return build_session(self.service, binding, self.thinking)

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
    pool: SessionPool, binding: Binding, history: list, sampling: SamplingParams, timeout
) -> Iterator[Any]:
    """Session events of one turn, read in the calling thread. Closing early aborts."""
    session = pool.acquire(binding)
    gateway: Gateway = session.engine
    gateway.call = Call(pool.service, timeout)
    events = session.send(history, sampling)
    try:
        yield from events
    finally:
        events.close()
        gateway.call = None
        pool.release(binding, session)


async def arun_turn(
    pool: SessionPool, binding: Binding, history: list, sampling: SamplingParams, timeout
) -> AsyncIterator[Any]:
    """The same on an asyncio loop. The Session is synchronous, so it runs in a thread whose
    events come through a queue; cancelling the reading task aborts the engine request at once
    (before the cancellation propagates), not when the thread notices."""
    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
    session = pool.acquire(binding)
    gateway: Gateway = session.engine
    call = gateway.call = Call(pool.service, timeout)

    def post(kind: str, item: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody reads any more
            loop.call_soon_threadsafe(inbox.put_nowait, (kind, item))

    def work() -> None:
        try:
            for event in session.send(history, sampling):
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
            yield item
    finally:
        if not done:
            call.cancel()
