"""TextRun: one text completion, its prompt submitted straight to the EngineService.

    run = TextRun(service, prompt, sampling)
    await run.start()              # tokenized and submitted; bad input raises here (-> 400)
    async for event in run.events(): ...   # TokenEvents that carry text (or logprobs), Usage
    run.cancel()                   # any time: aborts the request, frees its pages

No Session and no chat template: the prompt's ids are the engine's prompt, so the text is what
`Engine.generate` gives for them. With `echo` the prompt's text comes first, as an Echo piece
ahead of the first token's event (echo.py), and the reply and logprobs start with the prompt's.
The engine's prompt entries (SamplingParams.prompt_logprobs) come on the request's first event:
`prompt_logprobs` keeps them. A TextRun reads like a TurnRun (`events`, `usage`, `reply`,
`finish_reason`, `cancel`), so the routes stream it, collect it and abort it when the client
leaves the same way (openai_routes.py). Tokenizing and submitting run in a worker thread: a
long prompt's tokenization, or the engine lock held through a step, must not stall the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator

from freetoken_agent.anchor_options import is_hybrid, page_size, shared_prompt_anchors
from freetoken_agent.engine.outputs import (
    ContextLengthError,
    InvalidRequestError,
    SchemaError,
    TokenEvent,
    TokenLogprob,
    shown_number,
)
from freetoken_agent.engine.sampling_params import SamplingParams
from freetoken_agent.integrations.server.bridge import request_figures
from freetoken_agent.integrations.server.echo import (
    Echo,
    EchoedPrompt,
    Entry,
    echoed_prompt,
    reply_offset,
)
from freetoken_agent.integrations.server.errors import BadParam
from freetoken_agent.integrations.server.turn_run import failed_at_once, put_first_event
from freetoken_agent.service import EngineService, Sink
from freetoken_agent.session import Usage


def _named(error: InvalidRequestError) -> BadParam:
    """The engine's refusal of a request, naming the field at fault: the prompt (empty, ids
    outside the vocabulary, too long for the context), a response_format's schema, or the
    field the error names itself (`param`: a logit_bias id outside the vocabulary)."""
    text = str(error)
    if isinstance(error, SchemaError):
        return BadParam(text, "response_format")
    if getattr(error, "param", None):
        return BadParam(text, error.param)
    code = "context_length_exceeded" if isinstance(error, ContextLengthError) else None
    return BadParam(text, "prompt", code)


class TextRun:
    def __init__(
        self,
        service: EngineService,
        prompt: str | list[int],
        sampling: SamplingParams,
        echo: bool = False,
        shared: bool = False,
    ) -> None:
        """`shared`: other runs send the same prompt beside it (the choices of `n`)."""
        self.service = service
        self.prompt = prompt
        self.sampling = sampling
        self.echo = echo
        self.shared = shared
        self.prompt_tokens = 0
        self.usage: Usage | None = None  # set when the request has ended
        self._pieces: list[str] = []
        # Each token's log-probabilities and the offset of its text in the reply, in order,
        # when asked (the whole response's; a stream's chunks are written by the format):
        # with echo, the prompt's tokens first.
        self.logprobs: list[Entry] = []
        # The engine's prompt entries, from the first event (None: not asked, or none came).
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self._echoed: EchoedPrompt | None = None  # with echo: the prompt as echoed
        self._generated = 0
        self._echo_chars = 0  # the echoed prompt's characters, before the reply's
        self._reply_chars = 0  # characters of the reply released so far
        self._figures: dict[str, int] | None = None  # the engine's reuse figures, at the end
        self._request_id: str | None = None
        self._cancelled = False
        self._lock = threading.Lock()  # cancel() either sees the request id or stops the submit
        self._events: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self._sink: Sink | None = None  # what the service knows this submission by
        # Set at the request's first engine event: its prompt is cached by then (choices.py
        # starts the other choices at it). Every request has one (its final event at least).
        self.first_event = asyncio.Event()
        self.failed_early = False  # its first event was its failure (choices.py reads it)

    def _ids(self) -> list[int]:
        tokenizer = self.service.tokenizer
        if isinstance(self.prompt, str) and tokenizer is None:
            raise BadParam(
                "this model has no tokenizer: send prompt as a list of token ids", "prompt"
            )
        if self.echo:  # the same ids, and the text and offsets to echo
            if isinstance(self.prompt, list):
                # Before the echo decodes them (the engine checks them too, later, after the
                # length: a decode of an id out of range raises inside the tokenizer).
                vocab = self.service.spec.vocab_size
                bad = next((t for t in self.prompt if not 0 <= t < vocab), None)
                if bad is not None:
                    raise BadParam(
                        f"token id {shown_number(bad)} is outside the vocabulary [0, {vocab})",
                        "prompt",
                    )
            generates = self.sampling.max_tokens != 0  # (nothing after the echo: it shows all)
            self._echoed = echoed_prompt(self.prompt, tokenizer, leave_cut=generates)
            return self._echoed.ids
        if isinstance(self.prompt, list):
            return self.prompt
        # As Engine.submit encodes a string: with the model's bos, if it has one.
        return tokenizer.encode(self.prompt, add_special_tokens=True)

    def _submit(self, loop: asyncio.AbstractEventLoop) -> None:  # in a worker thread
        first = True

        def deliver(event: TokenEvent) -> None:  # on the engine thread, under service.lock
            nonlocal first
            if event.finished:
                self._figures = request_figures(event)
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody reads any more
                loop.call_soon_threadsafe(self._events.put_nowait, event)
            if first:
                first = False
                self.failed_early = failed_at_once(event)
                put_first_event(loop, self.first_event)

        ids = self._ids()
        self.prompt_tokens = len(ids)
        with self._lock:
            if self._cancelled:
                return
            self._sink = deliver
            try:
                self._request_id = self.service.submit(ids, self.sampling, deliver,
                                                       **self._options(ids))  # fmt: skip
            except InvalidRequestError as e:
                raise _named(e) from None

    def _options(self, ids: list[int]) -> dict:
        """Engine.submit's options beyond the prompt and sampling, only those that apply: with
        echo, `prompt_echoed` (a character the ids cut is the reply's to show)."""
        return {**({"prompt_echoed": True} if self.echo else {}), **self._anchors(ids)}

    def _anchors(self, ids: list[int]) -> dict:
        """For choices sharing the prompt on a hybrid model: `shared_prompt_anchors`.
        Attention-only models reuse any cached prefix as is."""
        if not self.shared or len(ids) < 2 or not is_hybrid(self.service):
            return {}
        return {"anchors": shared_prompt_anchors(len(ids), page_size(self.service))}

    async def start(self) -> int:
        """Tokenize and submit; returns the prompt's token count. Refusals raise here."""
        try:
            await asyncio.to_thread(self._submit, asyncio.get_running_loop())
        except BaseException:
            self.cancel()  # a cancelled start: the thread may still have submitted
            raise
        return self.prompt_tokens

    async def events(self) -> AsyncIterator[TokenEvent | Echo | Usage]:
        """With echo, the Echo first; the events that carry text or, asked for, a token's
        log-probabilities (a token whose text is held back still has them), then the Usage
        (finish_reason "error", with the engine's message, when the request failed)."""
        first = True
        while self.usage is None:
            event = await self._events.get()
            if first:
                first = False
                self.prompt_logprobs = event.prompt_logprobs
                if self._echoed is not None:
                    yield self._echo(event.prompt_logprobs)
            if event.token_id is not None:
                self._generated += 1
            entry = event.token_logprob()
            if entry is not None:
                self.logprobs.append(
                    (entry, self._echo_chars + reply_offset(event, self._reply_chars))
                )
            if event.text:
                self._pieces.append(event.text)
                self._reply_chars += len(event.text)
            if event.text or entry is not None:
                yield event
            if event.finished:
                end = self._echo_chars + self._reply_chars  # tokens a stop string cut away
                self.logprobs = [(e, min(offset, end)) for e, offset in self.logprobs]
                figures = self._figures or {"reused": 0, "prefilled": self.prompt_tokens}
                self.usage = Usage(
                    self.prompt_tokens,
                    self._generated,
                    figures["reused"],
                    figures["prefilled"],
                    event.finish_reason,
                    event.error,
                    exact=self._figures is not None,
                )
                yield self.usage

    def _echo(self, entries: list[TokenLogprob | None] | None) -> Echo:
        """The echoed prompt, its text and entries counted as the reply's first."""
        echo = self._echoed.piece(entries, self.sampling.logprobs)
        self._pieces.append(echo.text)
        self._echo_chars = len(echo.text)
        self.logprobs.extend(echo.logprobs)
        return echo

    @property
    def reply(self) -> str:
        """The text so far (all of it once the run has ended)."""
        return "".join(self._pieces)

    def finish_reason(self) -> str | None:
        return self.usage.finish_reason if self.usage is not None else None

    def cancel(self) -> None:
        """Abort the request (a no-op once it has ended). On the loop: the abort never waits
        for the engine's lock, and the service wakes the reader with the request's final
        event (its only end)."""
        with self._lock:
            if self._cancelled:
                return
            self._cancelled = True
            rid = self._request_id
        if rid is not None and self.usage is None:
            self.service.abort(rid, self._sink)  # a no-op if the engine finished it meanwhile
