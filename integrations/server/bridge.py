"""EngineBridge: what a server Session takes for its engine, so the event loop can stop a turn.

A Session is synchronous: `session.send` calls `engine.stream(ids, sampling)` and blocks on it,
so the server runs it in a worker thread. The event loop must still be able to end that turn at
once when its client goes away (the request aborted, its KV pages freed) even while the worker
is blocked waiting for the next token. Each turn therefore gets a `Turn`: it submits through
`EngineService.submit` with its own queue, remembers the request id, and `Turn.cancel()` (from
any thread, the event loop's included: it never waits for the engine's lock) aborts the
request; the service wakes the worker with the request's final "abort" event, which the
Session handles like any early end.

A Turn also carries what the server adds to a Session's prompt (the opener of a forced tool
call, `suffix_ids`), the engine's own figures for its request (reused and prefilled tokens),
which stay exact however many requests run at once, and the prompt's log-probabilities its
first event brings when the request asked (vLLM's prompt_logprobs: the Session passes on the
generated tokens' only).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Sequence

from freetoken_agent.engine.outputs import TokenEvent, TokenLogprob
from freetoken_agent.engine.sampling_params import SamplingParams
from freetoken_agent.service import EngineService, ServiceView


class TurnCancelled(Exception):
    """The turn was cancelled before its request reached the engine."""


def request_figures(event: TokenEvent) -> dict[str, int] | None:
    """A final event's reused/prefilled token counts (TokenEvent.reused_tokens and
    prefilled_tokens, the engine's own for that request); None on a final event the engine
    did not write (the service's abort of a request it never stepped), where callers fall
    back to the Session's figures."""
    if event.reused_tokens is None or event.prefilled_tokens is None:
        return None
    return {"reused": event.reused_tokens, "prefilled": event.prefilled_tokens}


class Turn:
    """One engine request of one turn, cancellable from any thread."""

    def __init__(self, service: EngineService) -> None:
        self.service = service
        self.suffix_ids: list[int] = []  # appended to the Session's prompt (forced tool calls)
        self.on_submit: Callable[[int], None] | None = None  # called with the prompt length
        # Called once, on the engine thread, with the request's first event: its prompt is
        # computed and cached by then (choices.py starts the other choices at it).
        self.on_first_event: Callable[[TokenEvent], None] | None = None
        self.figures: dict[str, int] | None = None  # set when the request finishes
        # The engine's prompt entries (TokenEvent.prompt_logprobs), when asked and computed.
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self.request_id: str | None = None
        self.cancelled = False
        self._lock = threading.Lock()
        self._events: queue.SimpleQueue[TokenEvent] = queue.SimpleQueue()
        self._sink = self._deliver  # what the service knows this submission by

    def _deliver(self, event: TokenEvent) -> None:  # on the engine thread, under service.lock
        first, self.on_first_event = self.on_first_event, None
        if first is not None:
            first(event)
        if event.prompt_logprobs is not None:
            self.prompt_logprobs = event.prompt_logprobs
        if event.finished:
            self.figures = request_figures(event)
        self._events.put(event)

    def stream(
        self, prompt: Sequence[int], sampling: SamplingParams, **options
    ) -> Iterator[TokenEvent]:
        ids = [*prompt, *self.suffix_ids]
        with self._lock:  # cancel() either sees the request id or stops the submission
            if self.cancelled:
                raise TurnCancelled("the turn was cancelled before it started")
            self.request_id = self.service.submit(ids, sampling, self._sink, **options)
        if self.on_submit is not None:
            self.on_submit(len(ids))
        try:
            while True:
                event = self._events.get()
                yield event
                if event.finished:
                    return
        finally:
            # A no-op once it finished: a later request given the same id is not ours.
            self.service.abort(self.request_id, self._sink)

    def cancel(self) -> None:
        """Abort the request (its pages are freed by the next step at the latest); the
        service ends the reader with the request's final event, its only end."""
        with self._lock:
            if self.cancelled:
                return
            self.cancelled = True
            rid = self.request_id
        if rid is not None:
            self.service.abort(rid, self._sink)


class EngineBridge(ServiceView):
    """Quacks like the engine for a Session (tokenizer, spec, stats, stream); `stream` goes
    through the Turn the server set as `current` before calling `session.send`."""

    def __init__(self, service: EngineService) -> None:
        super().__init__(service)
        self.current: Turn | None = None

    @property
    def prompt_suffix(self) -> list[int]:
        """What the current turn appends to the Session's prompt (the Session counts it as
        sent: the next turn's divergence and reuse are measured against what the engine saw)."""
        return list(self.current.suffix_ids) if self.current is not None else []

    def stream(
        self, prompt: Sequence[int], sampling: SamplingParams, **options
    ) -> Iterator[TokenEvent]:
        if self.current is None:
            raise RuntimeError("EngineBridge.stream outside a server turn (set .current first)")
        return self.current.stream(prompt, sampling, **options)
