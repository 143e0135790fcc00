"""RequestOutcomes: what a step's results make of its requests.

The Engine loops (schedule -> run -> update); this is the update's bookkeeping. It turns a
step's output into each request's events: a sampled token's text, with the stop conditions
checked (stop ids and strings, EOS, a complete JSON value, the length), a score request's
logits rows kept, and a request's prompt log-probabilities kept by position
(prompt_logprobs.py) and handed out on its first event. And it ends requests (finished,
aborted, failed, a prompt-only one once its prompt is computed): their pages go back to the
scheduler, an abort's or a failure's last event is queued, and the totals `Engine.stats()`
reports are counted. It lives apart from engine.py because both loops end here alike: the
plain step (`Engine.step`) and the overlapped one (overlap.py, which accepts a step's tokens
one call later and fails the requests of a step in flight that failed).

It shares the Engine's per-request tables (`_outputs`, `_events`, `_scores`): the Engine adds
and drops requests, this fills their events and score rows.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import TYPE_CHECKING

import torch

from freetoken_agent.engine.layers.sampler import NOT_FINITE, not_finite_message
from freetoken_agent.engine.outputs import TokenEvent, TokenLogprob
from freetoken_agent.engine.prompt_logprobs import keep
from freetoken_agent.engine.request import Batch, Request, Status
from freetoken_agent.engine.request_metrics import RequestMetrics
from freetoken_agent.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from freetoken_agent.engine.constrained import Grammars
    from freetoken_agent.engine.output_state import OutputState
    from freetoken_agent.engine.runner import ModelRunner, StepOutput
    from freetoken_agent.engine.scheduler import Scheduler

log = logging.getLogger("freetoken.engine")


class RequestOutcomes:
    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        grammars: Grammars,
        outputs: dict[str, OutputState],
        events: dict[str, deque[TokenEvent]],
        scores: dict[str, list[torch.Tensor]],
        eos_token_ids: frozenset[int],
        max_model_len: int,
        dtype: torch.dtype,
    ) -> None:
        """`outputs`, `events`, `scores`: the Engine's tables (request id -> its text state,
        its events not taken yet, a score request's rows in order), shared, not copied."""
        self.scheduler, self.runner, self.grammars = scheduler, runner, grammars
        self.outputs, self.events, self.scores = outputs, events, scores
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.dtype = dtype
        self.totals = {"prefilled": 0, "reused": 0, "generated": 0, "finished": 0, "errors": 0}
        self.metrics = RequestMetrics()  # finished requests' latencies and finish reasons

    def update(self, batch: Batch, out: StepOutput) -> list[TokenEvent]:
        events: list[TokenEvent] = []
        for chunk in batch.chunks:
            req = chunk.request
            self.scheduler.advance(chunk)
            if req.score_only:
                keep_rows(self.scores[req.id], chunk.start, out.logits[req.id])
                if chunk.sample:
                    self.finish(req, "scored")
                continue
            if req.id in out.prompt_logprobs:
                keep(req, out.prompt_logprobs[req.id])
            if chunk.sample and not req.samples:
                events.append(self.prompt_only_end(req))
            elif chunk.sample:
                events.append(self.accept(req, out.sampled[req.id], out.logprobs.get(req.id)))
        return events

    def prompt_only_end(self, req: Request) -> TokenEvent:
        """A prompt-only request (max_tokens 0) has computed its prompt: it ends "length",
        its one event carrying the prompt's entries, with no token (as vLLM's finish reason
        for an echo of max_tokens 0)."""
        self.finish(req, "length")
        event = TokenEvent(req.id, None, "", 0, True, "length")
        event.prompt_logprobs = list(req.prompt_logprobs)
        _figures(event, req)
        self.events[req.id].append(event)
        return event

    def accept(self, req: Request, token: int, logprob: TokenLogprob | None = None) -> TokenEvent:
        """`_accept`, guarded: an error in one request's bookkeeping fails that request only.
        (Raised out of `step`, it failed every request of an overlapped pair, or, in the plain
        loop, left the engine raising at every step with the request never finished.)
        `logprob`: the token's, when the request asked (token_logprobs.py); it goes on the
        token's event and the output, whatever text the token makes (none, held back, cut)."""
        try:
            return self._accept(req, token, logprob)
        except Exception as e:  # noqa: BLE001 - one request must not take the engine down
            if req.status is Status.FINISHED:
                raise  # it failed while finishing: not something to finish twice
            log.exception("accepting a token of request %s failed; failing it", req.id)
            return self.fail_request(req, f"{type(e).__name__}: {e}")

    def _accept(self, req: Request, token: int, logprob: TokenLogprob | None) -> TokenEvent:
        problem = self.grammars.problem(req.id)
        if problem is not None:  # its grammar allowed no token: end this request only
            return self.fail_request(req, problem)
        if token == NOT_FINITE:  # nothing to sample from (layers/sampler.py): this request only
            message = not_finite_message(len(req.output_ids), self.dtype)
            return self.fail_request(req, message)
        now = time.perf_counter()
        req.first_token_time = req.first_token_time or now
        req.output_ids.append(token)
        if logprob is not None:
            req.output_logprobs.append(logprob)
        self.scheduler.checkpoint_decode(req, token)
        state = self.outputs[req.id]
        offset = len(state.text)  # where this token's text begins
        sp = req.sampling
        reason = None
        if sp.ends_with(token, self.eos_token_ids):
            reason = "stop"
            text = state.release(final=True)
        else:
            text = state.push(token)
            req.mid_character = state.mid_character  # the thinking budget's close waits
            if state.stopped:
                reason = "stop"
            elif self.grammars.advance(req.id, token):  # the JSON is complete: nothing follows
                reason = "stop"
                text += state.release(final=True)
            elif req.at_length(self.max_model_len):
                text += state.release(final=True)
                # The last characters, flushed, may complete a stop string (then cut there).
                reason = "stop" if state.stopped else "length"
        event = TokenEvent(req.id, token, text, len(req.output_ids) - 1)
        event.text_offset = min(offset, len(state.text))  # (a stop string may cut before it)
        if logprob is not None:
            event.logprob, event.top_logprobs = logprob.logprob, logprob.top
        if req.prompt_logprobs is not None and len(req.output_ids) == 1:  # final from now on
            event.prompt_logprobs = list(req.prompt_logprobs)
        if reason is not None:
            self.finish(req, reason)
            event.finished, event.finish_reason = True, reason
            event.stop_string = state.stop_string
            _figures(event, req)
        self.events[req.id].append(event)
        return event

    def finish(self, req: Request, reason: str) -> None:
        self.scheduler.finish(req, reason)
        self.runner.forget(req.id)
        # Its device tensors. A step in flight may still read or add to them: their memory is
        # only reused by later work on the same stream, which runs after that step's.
        req.token_history = None
        self.grammars.forget(req.id)
        self.totals["prefilled"] += req.num_prefilled
        self.totals["reused"] += req.num_reused
        self.totals["generated"] += len(req.output_ids)
        self.totals["finished"] += 1
        self.metrics.observe(req)
        if reason in ("abort", "error"):
            # The text held back (a possible stop string's start, a partial character) is
            # final now: streamed here, the events add up to the output's text.
            text = self._held_text(req.id)
            event = TokenEvent(req.id, None, text, len(req.output_ids), True, reason, req.error)
            _figures(event, req)
            self.events[req.id].append(event)

    def _held_text(self, rid: str) -> str:
        """The text a request's state still holds back, released as final; "" when the state
        is gone or itself broken (the request may be failing for that very reason)."""
        state = self.outputs.get(rid)
        if state is None:
            return ""
        try:
            return state.release(final=True)
        except Exception:  # noqa: BLE001 - the request ends either way
            log.exception("the text state of request %s failed at its end", rid)
            return ""

    def fail(self, batch: Batch, error: Exception) -> list[TokenEvent]:
        message = f"{type(error).__name__}: {error}"
        return [self.fail_request(chunk.request, message) for chunk in batch.chunks]

    def fail_request(self, req: Request, message: str) -> TokenEvent:
        req.error = message
        self.totals["errors"] += 1
        self.finish(req, "error")
        return self.events[req.id][-1]


def stop_strings(sampling: SamplingParams) -> list[str]:
    """The stop strings the request's output is searched for (`SamplingParams.stops_apply`;
    `accept` tests stop ids by the same rule)."""
    return sampling.stop if sampling.stops_apply else []


def keep_rows(kept: list[torch.Tensor], start: int, rows: torch.Tensor) -> None:
    """Add a score request's logits rows for positions [start, start + len(rows)) to `kept`
    (its rows from 0 so far, chunk by chunk). A preempted request computes again from an
    earlier position (a score request, reusing no prefix, from 0): the rows kept at or past
    `start` are dropped first, or the result would hold them twice."""
    held = 0
    for i, chunk in enumerate(kept):
        if held + len(chunk) > start:
            kept[i:] = [chunk[: start - held]] if start > held else []
            break
        held += len(chunk)
    kept.append(rows)


def _figures(event: TokenEvent, req: Request) -> None:
    """A final event's prompt figures: the request's own, exact under concurrency (the
    engine's totals move by every request that finishes), of its prompt: the tokens the cache
    gave at its first admission and the rest (they add up to the prompt, as a usage's
    must; re-prefills after a preemption are work, in the engine's totals)."""
    if req.admissions == 0:  # it ended before it ran (cancelled, or the service closed)
        event.reused_tokens = event.prefilled_tokens = 0
        return
    event.reused_tokens = req.prompt_reused
    event.prefilled_tokens = len(req.prompt_ids) - req.prompt_reused
