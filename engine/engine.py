"""Engine: load a model, take requests, loop schedule -> run -> update.

    engine = Engine.load("path/to/hf-folder")
    out = engine.generate("Hello", SamplingParams(max_tokens=32, temperature=0))
    for event in engine.stream(prompt_ids, sampling): ...

`step()` is one iteration of the loop: the Scheduler decides the batch (a safe point: nothing is
in flight), the ModelRunner executes it, and the Engine turns sampled tokens into events, checks
stop conditions and hands finished requests' pages back (that bookkeeping: request_outcomes.py).
With overlap scheduling (EngineConfig.overlap_schedule, overlap.py) a decode step is launched
before the previous step's tokens are turned into events, so its events come from the next
call. The engine is not thread-safe: one thread drives it (servers run it in a loop thread and
talk to it through queues).
"""

from __future__ import annotations

import functools
import itertools
import logging
import numbers
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from freetoken_agent.engine import frontends
from freetoken_agent.engine.constrained import Grammars
from freetoken_agent.engine.experts.offload import OffloadedExpertBank
from freetoken_agent.engine.graph_capture import capture_decode_graphs
from freetoken_agent.engine.loading import LoadedModel, load_model
from freetoken_agent.engine.memory_setup import elastic_memory
from freetoken_agent.engine.output_state import OutputState
from freetoken_agent.engine.outputs import (
    EngineClosedError,
    GenerationOutput,
    InvalidRequestError,
    TokenEvent,
    TokenLogprob,
)
from freetoken_agent.engine.overlap import Overlap
from freetoken_agent.engine.prompt_input import Prompt
from freetoken_agent.engine.request import Request, Status
from freetoken_agent.engine.request_intake import RequestIntake
from freetoken_agent.engine.request_outcomes import RequestOutcomes
from freetoken_agent.engine.runner import ModelRunner
from freetoken_agent.engine.sampling_params import SamplingParams
from freetoken_agent.engine.scheduler import Scheduler
from freetoken_agent.engine.stats import engine_stats, request_stats
from freetoken_agent.engine.teardown import release
from freetoken_agent.engine.text.markers import marker_ids
from freetoken_agent.engine.thinking_budget import thinking_markers

log = logging.getLogger("freetoken.engine")
CLOSED = "the engine was closed (Engine.close) while this request ran"


def _serialised(method):
    """`method` under the engine's lock (the class docstring): two threads stepping at once
    corrupted each other's batches (interleaved, duplicated tokens, no error)."""

    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self.lock:
            return method(self, *args, **kwargs)

    return locked


class Engine:
    """One model served: `Engine.load(path)`, then `generate` / `stream` / `score` (or
    `submit` + `step` by hand); `stats()` reports the memory split and reuse, `set_gpu_budget`
    re-splits the GPU budget live, `close()` gives VRAM and pinned memory back. Its calls
    that change or step it run one at a time under `lock` (an RLock, which an EngineService
    driving the engine shares), so threads calling it at once take turns step by step: an
    engine handed to ChatFreeToken (whose service thread steps it) can still be called
    directly. A server drives it from one thread (freetoken_agent.service.EngineService)."""

    def __init__(self, loaded: LoadedModel) -> None:
        self.lock = threading.RLock()
        self.loaded = loaded
        self.spec = loaded.spec
        self.config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.kv = loaded.kv
        self.radix = loaded.radix
        self.scheduler = Scheduler(
            loaded.kv.allocator,
            loaded.radix,
            loaded.kv.page_size,
            self.config.max_num_seqs,
            self.config.max_batched_tokens,
            loaded.recurrence,
        )
        self.thinking = thinking_markers(self.tokenizer)  # None: no thinking budget here
        if self.config.thinking_budget is not None and self.thinking is None:
            log.warning(
                "thinking_budget=%d is ignored: this model's vocabulary has no <think> and "
                "</think> tokens",
                self.config.thinking_budget,
            )
        self.runner = ModelRunner(
            loaded.model,
            loaded.kv,
            loaded.device,
            self.config.seed,
            loaded.eos_token_ids,
            self.thinking,
        )
        if isinstance(loaded.bank, OffloadedExpertBank):  # policy direct learns between steps
            self.runner.after_step = loaded.bank.after_step
            self.runner.on_decode_step = loaded.bank.decode_step_timed
        self.memory = elastic_memory(loaded, self.scheduler)
        self.overlap = Overlap(self, self.config.overlap_schedule)
        self.graph_error: str | None = None  # why decode runs without graphs, if it does
        if loaded.device.type == "cuda" and self.config.cuda_graphs:
            self.capture_graphs()
        self._requests: dict[str, Request] = {}
        self._outputs: dict[str, OutputState] = {}
        self._events: dict[str, deque[TokenEvent]] = {}
        self._scores: dict[str, list[torch.Tensor]] = {}  # a score request's rows, in order
        self._ids = itertools.count()
        # Constrained requests' grammars (json_schema); the library loads on the first one.
        self.grammars = Grammars(self.tokenizer, self.spec.vocab_size, self.eos_token_ids)
        # Special tokens that are a tool-call or reasoning tag stay in the output text for the
        # parsers (Mixtral's [TOOL_CALLS]); every other one is skipped (text/markers.py).
        self.intake = RequestIntake(
            self.tokenizer,
            self.spec.vocab_size,
            self.max_model_len,
            self.thinking,
            self.config.thinking_budget,
            loaded.recurrence,
            marker_ids(self.tokenizer),
        )
        self.outcomes = RequestOutcomes(
            self.scheduler,
            self.runner,
            self.grammars,
            self._outputs,
            self._events,
            self._scores,
            self.eos_token_ids,
            self.max_model_len,
            loaded.dtype,
        )
        self._stalled: Request | None = None  # a waiting request no step could admit

    def capture_graphs(self) -> None:
        """(Re)capture the decode graphs: after the model's expert bank object changes. A
        capture the driver invalidates is tried once more; if that fails too, decode runs
        without graphs, slower but correct, and `graph_error` says why (graph_capture.py)."""
        bank = self.loaded.bank
        offloaded = bank if isinstance(bank, OffloadedExpertBank) else None
        max_pages = -(-self.max_model_len // self.loaded.kv.page_size)
        rec = self.scheduler.recurrence
        states = rec.states if rec is not None and self.config.hybrid_run_ahead else None
        self.graph_error = capture_decode_graphs(
            self.runner, self.config.max_num_seqs, max_pages, offloaded, states
        )

    @classmethod
    def load(
        cls,
        path: str | Path,
        device: str = "auto",
        dtype: str | torch.dtype | None = None,
        gpu_budget: int | None = None,
        policy: str = "adaptive",
        progress: bool = True,
        **options,
    ) -> Engine:
        """Load an HF folder or an FTW checkpoint (`freetoken convert`).

        `device`: "auto" (CUDA when torch sees it), "cpu", "cuda" or "cuda:N"; `dtype`: the
        checkpoint's when None; `gpu_budget`: bytes of GPU memory to use (None: free memory
        less `memory_reserve`); `policy`: where expert misses run (engine/config.POLICIES).
        `options` set any other EngineConfig field (engine/engine_config.py documents each),
        e.g. max_model_len, kv_tokens, page_size, max_num_seqs, max_batched_tokens,
        cuda_graphs, seed, thinking_budget, checkpoints ("anchors", "positional:N", "none"),
        memory_reserve, follow_free_memory, elastic, overlap_schedule, double_buffer,
        expert_slots. A name that is not a field is refused, naming the closest one."""
        return cls(load_model(path, device, dtype, gpu_budget, policy, progress, **options))

    # --- limits ---------------------------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        """Longest sequence (prompt + output) a request may reach: the model's context, capped
        by what the KV pool can hold for one sequence."""
        return self.loaded.max_model_len

    # --- requests -------------------------------------------------------------------------
    @_serialised
    def submit(
        self,
        prompt: Prompt,
        sampling: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        use_prefix_cache: bool = True,
        anchors: Sequence[int] = (),
        anchor_tokens: Sequence[int] = (),
        prompt_echoed: bool = False,
        _score: bool = False,
    ) -> str:
        """Queue a request; returns its id. Bad input raises InvalidRequestError here, before
        anything runs (and before the request takes anything: a grammar, a place in the
        tables), so it can never disturb other requests.

        Hybrid models: `anchors` are token boundaries of the prompt (the Session's semantic
        anchors: the state after prompt[:a]) where prefilling checkpoints the recurrent state,
        and `anchor_tokens` generated tokens before which decoding does; later requests
        sharing a prefix resume from the deepest checkpoint in it (EngineConfig.checkpoints).

        `prompt_echoed`: the caller shows the prompt's text before the reply (the legacy
        completions' echo) and leaves a character the prompt's ids cut to the reply, which
        then shows it whole when completed, else as U+FFFD (engine/text/detokenizer.py).

        Driven by hand (step, then take_events), the request stays in the engine's tables
        once finished until `release(request_id)`."""
        self._open()
        request_id = request_id or self._new_id()
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        req, output = self.intake.build(
            request_id,
            prompt,
            sampling,
            use_prefix_cache=use_prefix_cache,
            anchors=anchors,
            anchor_tokens=anchor_tokens,
            score=_score,
            prompt_echoed=prompt_echoed,
        )
        if req.sampling.constraint is not None and not _score:
            self.grammars.add(request_id, req.sampling.constraint)
        self._requests[request_id] = req
        self._outputs[request_id] = output
        self._events[request_id] = deque()
        if _score:
            self._scores[request_id] = []
        self.scheduler.add(req)
        return request_id

    def _new_id(self) -> str:
        """The next free `req-N`: a client may have named its own request so."""
        while (request_id := f"req-{next(self._ids)}") in self._requests:
            pass
        return request_id

    @_serialised
    def set_gpu_budget(self, nbytes: int) -> None:
        """Change the GPU budget while running; applied at the next safe point (KV pages and
        expert slots re-split, requests preempted rather than failing if even the fewest slots
        leave too few pages). At most the ceiling the arena reserved addresses for
        (EngineConfig.gpu_ceiling); higher values are capped there. A budget below the floor
        (dense weights, workspace, recurrent memory, 2 KV pages and the fewest expert slots:
        `engine.memory.floor`) is an InvalidRequestError that names it."""
        self._open()
        if isinstance(nbytes, float) and nbytes.is_integer():  # 8e9 bytes
            nbytes = int(nbytes)
        if isinstance(nbytes, bool) or not isinstance(nbytes, numbers.Integral):
            raise InvalidRequestError(f"the GPU budget is a count of bytes, got {nbytes!r:.40}")
        if self.memory is None:
            raise InvalidRequestError(
                "this engine's memory is not elastic (experts resident, elastic=False, or no "
                "budget on a CPU device): its budget is fixed at load"
            )
        try:
            self.memory.set_budget(nbytes)
        except ValueError as e:
            raise InvalidRequestError(str(e)) from e
        if not self.has_unfinished():  # idle: between steps already, apply it now
            self.overlap.drain()  # idle: only finished requests' rows, no events
            self.memory.safe_point()

    @_serialised
    def poll_memory(self) -> int | None:
        """An idle engine's safe point: follow free device memory (yield VRAM another program
        took, regain what it released) and apply a pending budget. Does nothing while requests
        run (each step's safe point polls). Returns the budget (None: memory not elastic)."""
        self._open()
        if self.memory is None:
            return None
        if not self.has_unfinished():
            self.overlap.drain()  # idle: only finished requests' rows, no events
            self.memory.safe_point()
        return self.memory.budget

    @_serialised
    def release(self, request_id: str) -> None:
        """Forget a request: abort it if it is unfinished, then drop what the engine keeps for
        its owner (events not taken, its text, its figures). A caller driving the engine with
        submit / step / take_events calls it once it has the final event (the engine keeps a
        finished request until then, for the owner to read); its id may then be used again.
        generate, stream and EngineService release their own. An unknown id does nothing."""
        self.abort(request_id)
        self._pop(request_id)

    @_serialised
    def abort(self, request_id: str) -> None:
        req = self._requests.get(request_id)
        if req is not None and req.status is not Status.FINISHED:
            self.outcomes.finish(req, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler is not None and self.scheduler.has_work()

    @_serialised
    def take_events(self, request_id: str) -> list[TokenEvent]:
        """The request's events not taken yet, oldest first. Whoever steps the engine, each
        event waits here for the request's owner (an EngineService, `stream`), so a caller
        stepping for its own requests never swallows another's."""
        queue = self._events.get(request_id)
        if not queue:
            return []
        events = list(queue)
        queue.clear()
        return events

    @property
    def closed(self) -> bool:
        return self.loaded is None

    def close(self) -> None:
        """Give back now what the engine holds on the device and the host pool's page-locked
        memory (teardown.py); unfinished requests end with "abort", their error naming the
        close (an EngineService driving the engine passes it to its readers and stops). Every
        later call raises EngineClosedError; closing twice does nothing."""
        if self.loaded is not None:
            for req in self._requests.values():
                if req.status is not Status.FINISHED:
                    req.error = CLOSED
            release(self)

    def _open(self) -> None:
        if self.loaded is None:
            raise EngineClosedError("this engine was closed: load the model again to use it")

    # --- the loop -------------------------------------------------------------------------
    @_serialised
    def step(self) -> list[TokenEvent]:
        """One iteration; returns the events it produced. With overlap scheduling a decode
        step's events come from the next call, which launches the step after it first."""
        self._open()
        done: list[TokenEvent] = []
        if self.overlap.inflight is not None:
            lagged = self.overlap.step()
            if lagged is not None:
                return lagged
            done = self.overlap.drain()  # the next step is not a plain decode: step plainly
        if self.memory is not None:  # the safe point: the split moves before scheduling
            self.memory.safe_point()
        batch = self.scheduler.schedule()
        failed = [self.outcomes.fail_request(r, why) for r, why in self.scheduler.take_unservable()]
        failed = done + failed
        if not batch.chunks:
            return failed + self._unschedulable()
        self._stalled = None  # a step ran: a later stall gets its one more try again
        self.runner.apply_copies(self.scheduler.take_copies())
        try:
            if self.overlap.eligible(batch):
                self.overlap.launch(batch)  # its tokens are read by the next call
                return failed
            masks = self.grammars.masks(c.request.id for c in batch.chunks if c.sample)
            out = self.runner.run(batch, masks)
        except Exception as e:  # noqa: BLE001 - one failing batch must not take the engine down
            log.exception("step failed; failing the %d request(s) in it", len(batch.chunks))
            self._resync_experts()
            return failed + self.outcomes.fail(batch, e)
        except BaseException:  # Ctrl-C out of the step: the engine serves the next one
            self._resync_experts()
            raise
        return failed + self.outcomes.update(batch, out)

    def _resync_experts(self) -> None:
        """A step cut short may lie between an expert fill and its publish: the cache's device
        table is written again from its host maps (ExpertCache.resync). A streamed chunk cut
        short gives the slots it lent its ring back first: without elastic memory no safe
        point would, and decode steps replaying graphs never call the bank."""
        bank = self.loaded.bank
        streamer = getattr(bank, "streamer", None)
        if streamer is not None:
            streamer.release()
        cache = getattr(bank, "cache", None)
        if cache is not None:
            cache.resync()

    def _unschedulable(self) -> list[TokenEvent]:
        """Nothing ran although requests wait and none runs: the first cannot get its pages
        even from an empty pool (a shrunk elastic budget). Fail it, never wait forever."""
        sched = self.scheduler
        if sched.running or not sched.waiting:
            return []
        req = sched.waiting[0]
        if self._stalled is not req:  # the next safe point may still make room: one more try
            self._stalled = req
            return []
        self._stalled = None
        pages = self.kv.allocator.capacity
        return [
            self.outcomes.fail_request(
                req,
                f"the request needs KV for {req.n_tokens} tokens but the GPU budget now holds "
                f"{pages * self.kv.page_size} ({pages} pages); raise the budget or shorten it",
            )
        ]

    def accept(self, req: Request, token: int, logprob: TokenLogprob | None = None) -> TokenEvent:
        """One sampled token of `req` (and its log-probabilities, if asked) turned into its
        event; an error in one request's bookkeeping fails that request only
        (RequestOutcomes.accept)."""
        return self.outcomes.accept(req, token, logprob)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.loaded.eos_token_ids

    # --- convenience front-ends (frontends.py) ---------------------------------------------
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        **options,
    ) -> GenerationOutput | list[GenerationOutput]:
        """Run one prompt (returns one output) or a list of prompts batched together (returns a
        list, in order). `options` go to `submit` for every prompt (e.g. anchors=...)."""
        return frontends.generate(self, prompts, sampling, **options)

    def stream(
        self, prompt: Prompt, sampling: SamplingParams | None = None, **options
    ) -> Iterator[TokenEvent]:
        """Yield this request's events as they come; other requests progress meanwhile. Closing
        the iterator early aborts the request. `options` go to `submit` (anchors...), but for
        `stop` (frontends.stream)."""
        return frontends.stream(self, prompt, sampling, **options)

    def score(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Logits [T, vocab] (fp32, on the CPU) at every position of `token_ids`, computed from
        scratch (no prefix reuse) through the same paged path as generation."""
        return frontends.score(self, token_ids)

    def _collect(self, rid: str) -> GenerationOutput:
        req = self._requests[rid]
        state = self._outputs[rid]
        out = GenerationOutput(
            request_id=rid,
            prompt_ids=list(req.prompt_ids),
            token_ids=list(req.output_ids),
            text=state.text,
            finish_reason=req.finish_reason,
            stats=request_stats(req),
            error=req.error,
            logprobs=list(req.output_logprobs) if req.sampling.logprobs is not None else None,
            prompt_logprobs=None if req.prompt_logprobs is None else list(req.prompt_logprobs),
        )
        self._pop(rid)
        return out

    def _pop(self, rid: str) -> None:
        for table in (self._requests, self._outputs, self._events, self._scores):
            table.pop(rid, None)

    # --- introspection --------------------------------------------------------------------
    def stats(self) -> dict:
        """Model, memory, experts, tokens, checkpoints, elastic split, requests (stats.py)."""
        self._open()
        return engine_stats(self)

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
        rec = self.scheduler.recurrence
        if rec is not None:
            rec.states.check_integrity()
            rec.checkpoints.check_integrity()
        if self.memory is not None:
            self.memory.check_integrity()
        check = getattr(self.loaded.bank, "check_integrity", None)
        if check is not None:
            check()
