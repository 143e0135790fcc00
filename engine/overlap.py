"""Overlap scheduling: decode step N is launched before step N-1's tokens are read on the host.

Between two decode steps the host reads the sampled tokens, detokenizes, checks stops, emits
events, schedules, builds the next inputs and launches: ~0.5-0.6 ms with the device idle, of
a ~4 ms all-resident step at 48 layers on the H200 host (NOTES, fifteenth session). With
overlap (EngineConfig.overlap_schedule) step N takes its token ids on the device from step
N-1's sampled tokens, so the host launches it first and processes N-1 while it runs (SGLang's
overlap scheduler and vLLM's async scheduling do the same):

    call k:  schedule N (advance N-1, a page each) -> launch N, and once its first kernels are
             queued: wait for N-1's tokens (done by then), accept them (events, stops,
             finishes) -> sample N, its tokens (and the log-probabilities of rows that ask:
             token_logprobs.py) copied out behind an event -> return N-1's events

The token of step N-1 reaches the caller one launch later than without overlap; the steps come
faster. Step N is scheduled before N-1's tokens are known, so:
- a request that N-1 ends by length (max_tokens, the model's length) is left out of N;
- one that N-1 ends otherwise (EOS, a stop string, an abort) ran one step more: its row of N
  is dropped. Its pages and state slot were released at the finish; whoever gets them next
  writes after N on the same stream, so N's stray row cannot corrupt them (and its KV position
  is past the tokens the prefix cache took);
- N's host-side token ids are placeholders; `StepInputs.device_ids` carries the real ones.

Steps overlap only while each is a plain decode step; otherwise the step in flight is completed
first and the engine steps as without overlap:
- every running request decodes and none waits for admission (a new request drains);
- no score-only or prompt-only request (they sample nothing). Penalties and logit_bias
  overlap (their counts take each sampled token on the device, logits_processors.py), and so
  do grammars (json_schema, strict tools): N's masks are built when N samples, after N-1's
  tokens were accepted and advanced them, while N's forward runs on the device (SGLang
  overlaps its grammar masks so too);
- not policy direct (its `after_step` reads a step's exported routing, which N overwrites);
- a device row for every checkpoint taken ahead. A hybrid request's accept may checkpoint
  its state (a positional boundary, or its token is an anchor: the Session passes
  `<tool_call>`, `</think>`, `<|im_end|>`), and that checkpoint must hold the state before N
  updates it: so it is taken before N is launched (`Scheduler.ahead.checkpoint_ahead`) and, under
  anchors, kept at the accept only if the token is one (`settle_ahead`);
- the elastic memory's safe point is quiet (`MemoryManager.quiet_point`): a split moves only
  with nothing in flight;
- the pool gives every request its next page without a preemption.
Anything that must see the engine idle (a budget applied while idle, close) drains first.

Shapes: B rows of a step (one token each).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from freetoken_agent.engine.device_index import on_device
from freetoken_agent.engine.outputs import TokenEvent
from freetoken_agent.engine.request import Batch, Request, ScheduledChunk, Status
from freetoken_agent.engine.runner import LaunchedStep
from freetoken_agent.engine.token_logprobs import HostStaging, StepLogprobs, entries

if TYPE_CHECKING:
    from freetoken_agent.engine.engine import Engine

log = logging.getLogger("freetoken.engine")
PLACEHOLDER = 0  # a lagged step's host-side token id; the device reads the sampled one


@dataclass(slots=True)
class InFlight:
    """A decode step launched and sampled, its tokens not yet read on the host."""

    batch: Batch
    tokens: torch.Tensor  # [B] int64 on the device: what the step sampled, row by row
    host: torch.Tensor  # [B] int64: their copy on the host (pinned on CUDA), valid at `ready`
    ready: torch.cuda.Event | None  # recorded after the copy (None on a CPU device)
    launched_at: float
    advanced: bool = False  # its chunks advanced already (the next step was scheduled)
    # The asking rows' log-probabilities, staged on the host behind `ready` like `host`
    # (token_logprobs.py); None when no row asked.
    logprobs: StepLogprobs | None = None


class Overlap:
    def __init__(self, engine: Engine, enabled: bool) -> None:
        self.engine = engine
        self.enabled = enabled
        self.inflight: InFlight | None = None
        self.lagged_steps = 0  # steps launched with another in flight
        self.drains = 0  # steps in flight completed without a successor
        self._last_done: float | None = None  # when the last lagged completion read its tokens
        n, device = engine.config.max_num_seqs, engine.loaded.device
        pinned = device.type == "cuda"
        # Two host buffers and their events, alternating: step N's copy lands while N-1's is
        # being read (N-1 is always read before N+1 takes its pair back).
        self._host = [torch.empty(n, dtype=torch.int64, pin_memory=pinned) for _ in range(2)]
        self._ready = [torch.cuda.Event() for _ in range(2)] if pinned else [None, None]
        self._flip = 0
        self._logprobs = HostStaging(n, pinned)  # their pinned buffers, paired with these

    # --- the plain loop's side --------------------------------------------------------------
    def eligible(self, batch: Batch) -> bool:
        """Whether the plain loop may launch `batch` and return before reading its tokens."""
        if not self._on() or not batch.is_decode_only:
            return False
        return all(self._plain(c.request) for c in batch.chunks)

    def _on(self) -> bool:
        # Policy direct learns from each step's exported routing after it, which the next
        # step would overwrite (the benchmarks switch a bank's policy at run time).
        return self.enabled and getattr(self.engine.loaded.bank, "policy", None) != "direct"

    def _plain(self, req: Request) -> bool:
        # A score or prompt-only request samples nothing: its last chunk (one token, a
        # decode-shaped row) ends it in the plain loop's update.
        return req.samples

    def launch(self, batch: Batch) -> None:
        """Launch and sample `batch`; its tokens are read by the next `step` or `drain`."""
        self._last_done = None
        self._sample(self.engine.runner.launch(batch))

    def drain(self) -> list[TokenEvent]:
        """Complete the step in flight, if any: its tokens accepted, its events returned."""
        prev, self.inflight = self.inflight, None
        self._last_done = None
        if prev is None:
            return []
        self.drains += 1
        return self._complete(prev, since=prev.launched_at)

    # --- lagged steps -----------------------------------------------------------------------
    def step(self) -> list[TokenEvent] | None:
        """Launch the next decode step, then complete the one in flight while it runs; returns
        the completed step's events. None (nothing done but bookkeeping a drain repeats
        harmlessly) when the next step cannot overlap: the caller drains and steps plainly."""
        prev = self.inflight
        planned = self._next_batch(prev)
        if planned is None:
            return None
        nxt, rows = planned
        runner = self.engine.runner
        done: list[TokenEvent] = []
        started = False

        def complete_prev() -> None:  # once N's first kernels are queued
            nonlocal started
            if started:
                return
            started, self.inflight = True, None
            done.extend(self._complete(prev, since=self._last_done or prev.launched_at))
            self._last_done = time.perf_counter()

        if rows == list(range(len(rows))):
            ids = prev.tokens[: len(rows)]
        else:  # a row left (finished, aborted): gather, the index through pinned memory
            ids = prev.tokens.index_select(0, on_device(rows, torch.int64, prev.tokens.device))
        try:
            step = runner.launch(nxt, ids, between=complete_prev)
            complete_prev()  # (every launch calls it; a no-op then)
            self._sample(step)
        except Exception as err:  # noqa: BLE001 - a failing step fails its requests only
            log.exception("overlapped step failed; failing its %d request(s)", len(rows))
            self.inflight = None
            if not started:  # the step before computed: its tokens still count
                try:
                    complete_prev()
                except Exception:  # noqa: BLE001
                    log.exception("completing the step before failed too")
            # What is left of both: a request whose token was not accepted could never end.
            return done + self._fail(prev.batch, err) + self._fail(nxt, err)
        self.lagged_steps += 1
        return done

    def _next_batch(self, prev: InFlight) -> tuple[Batch, list[int]] | None:
        """Step N's batch (each live request's next token, a placeholder) and, per row, its
        row in `prev`; None when N cannot be launched before `prev` is read."""
        e = self.engine
        sched = e.scheduler
        if not self._on() or sched.waiting:
            return None
        chunks = prev.batch.chunks
        live = [c for c in chunks if c.request.status is Status.RUNNING]
        if len(live) != len(sched.running) or not all(self._plain(c.request) for c in live):
            return None  # another request runs (it prefills), or one needs the host's token
        if not prev.advanced:  # what `_complete` would do first; the pages need it now
            for c in live:
                sched.advance(c)
            prev.advanced = True
        row = {id(c.request): i for i, c in enumerate(chunks)}
        picked: list[ScheduledChunk] = []
        for c in live:
            req = c.request
            if req.at_length(e.max_model_len, more=1):  # ends at the accept of its token
                continue
            if not sched.grow_one(req):
                return None  # the pool is dry: the plain loop preempts
            picked.append(ScheduledChunk(req, req.num_computed, [PLACEHOLDER], sample=True))
        if not picked:
            return None
        # The memory's safe point before the checkpoints taken ahead, which it would count
        # as held (they are given back at the accept, before the next safe point).
        if e.memory is not None and not e.memory.quiet_point():
            return None
        # Checkpoints the accepts may take are taken now, before N updates the states; any
        # left unsettled by a drain are settled by its `_complete` as here.
        for c in picked:
            req = c.request
            if sched.ahead.may_checkpoint_at_accept(req) and not sched.ahead.checkpoint_ahead(req):
                return None
        return Batch(picked), [row[id(c.request)] for c in picked]

    # --- both -------------------------------------------------------------------------------
    def _sample(self, step: LaunchedStep) -> None:
        """Enqueue `step`'s sampling and the copy of its tokens to the host; it is in flight."""
        runner = self.engine.runner
        _, sampled = runner.sample_tokens(step, self._masks(step.batch))
        tokens = sampled.tokens  # the next step's input ids, on the device
        slot = self._flip
        host, ready = self._host[slot][: tokens.shape[0]], self._ready[slot]
        self._flip ^= 1
        # Copied before the event is recorded, so the event covers them too (None: no row asked).
        logprobs = self._logprobs.stage(sampled.logprobs, slot)
        if ready is not None:
            host.copy_(sampled.reported, non_blocking=True)  # NOT_FINITE rows: failed at accept
            ready.record()
        else:
            host = sampled.reported
        self.inflight = InFlight(step.batch, tokens, host, ready, step.start, logprobs=logprobs)
        runner.step_done(step)

    def _masks(self, batch: Batch) -> dict[str, np.ndarray] | None:
        """The grammar masks of `batch`'s constrained rows, from their grammars as the accepts
        so far left them: `step` completes N-1 (its accepts advance the grammars) before it
        samples N, so each mask holds every token before N's (a request N-1 finished is left
        out: its row is dropped at accept)."""
        ids = [
            c.request.id
            for c in batch.chunks
            if c.request.sampling.constraint is not None and c.request.status is Status.RUNNING
        ]
        return self.engine.grammars.masks(ids) if ids else None

    def _complete(self, prev: InFlight, since: float) -> list[TokenEvent]:
        """Read `prev`'s tokens and accept them (rows of finished requests are dropped); the
        decode-step hook is told the time from `since` (the last completion, or the launch)."""
        e = self.engine
        try:
            if prev.ready is not None:
                prev.ready.synchronize()
            tokens = prev.host.tolist()
            found = entries(prev.logprobs, tokens)
        except Exception as err:  # noqa: BLE001
            log.exception("a step in flight failed; failing its requests")
            return self._fail(prev.batch, err)
        now = time.perf_counter()
        live = [c for c in prev.batch.chunks if c.request.status is Status.RUNNING]
        if not prev.advanced:
            for c in live:
                e.scheduler.advance(c)
        events = []
        for c, tok, logprob in zip(prev.batch.chunks, tokens, found, strict=True):
            if c.request.status is Status.RUNNING:
                e.scheduler.ahead.settle_ahead(c.request, tok)  # before the accept may checkpoint
                events.append(e.accept(c.request, tok, logprob))
        hook = e.runner.on_decode_step
        if hook is not None and live:
            # Lagged steps follow each other without a gap: the time between two completions
            # is a step's (adaptive's split trials time their modes by it).
            hook(len(prev.batch.chunks), now - since)
        return events

    def _fail(self, batch: Batch, err: Exception) -> list[TokenEvent]:
        message = f"{type(err).__name__}: {err}"
        return [
            self.engine.outcomes.fail_request(c.request, message)
            for c in batch.chunks
            if c.request.status is not Status.FINISHED
        ]
