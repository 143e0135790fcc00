"""One turn of a benchmark session on one engine (bench/elastic.py, bench/decode_profile.py): a
request alone in the engine, its decode counters taken from its first token on.

`TurnRun` runs a turn in parts (start: submit and prefill; decode: some steps; finish: the row),
so a session of several engines can decode their turns in alternating blocks of steps
(`bench/elastic_session.py`, `--interleave-block`): the device machine's host speed switches
between two levels for seconds at a time (a decode step's host time ~6.5 or ~10.5 ms at the
Qwen3.6 shape, in every engine alike), and turns run one after another compared those levels as
much as the engines. Each turn's times are its own steps only: `decode_tok_s` is the decoded
tokens over the engine's own decode time, each block ending on a device synchronize."""

from __future__ import annotations

import contextlib
import cProfile
import gc
import statistics
import time

import torch

from freetoken_agent.bench.turn_watch import TurnWatch
from freetoken_agent.engine.engine import Engine
from freetoken_agent.engine.outputs import InvalidRequestError
from freetoken_agent.engine.sampling_params import SamplingParams


def _counters(engine: Engine) -> tuple[float, ...]:
    """(experts, hits, fetched, on_cpu, safe-point seconds, routing-wait seconds, layers with a
    miss, segments rerun) so far. The routing wait: host time blocked on the
    device inside segmented decode graphs, so a slower step is told device-bound (it grows)
    from host-bound (it does not). A layer with a miss stops the step for the host (the same
    misses spread over more layers cost more stops)."""
    st = getattr(engine.loaded.bank, "stats", None)
    bank = (st.experts, st.hits, st.fetched, st.on_cpu) if st is not None else (0, 0, 0, 0)
    memory = engine.memory.safe_point_s if engine.memory is not None else 0.0
    graphs = engine.runner.graphs
    wait = getattr(graphs, "wait_s", 0.0)
    stalls = (getattr(graphs, "missed_layers", 0), getattr(graphs, "reruns", 0))
    return (*bank, memory, wait, *stalls)


class GcClock:
    """Seconds the garbage collector ran while it is installed (gc.callbacks): a decode step
    that is slow because a collection walked the heap is told apart from one whose own work
    grew."""

    def __init__(self) -> None:
        self.seconds, self.collections, self._t0 = 0.0, 0, None

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            self.seconds += time.perf_counter() - self._t0
            self.collections += 1
            self._t0 = None

    def __enter__(self) -> GcClock:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self)


def _enabled(profile: cProfile.Profile | None):
    """`profile` on for the block (a Profile is its own context manager), or nothing."""
    return profile if profile is not None else contextlib.nullcontext()


def step_spread(steps_s: list[float]) -> dict:
    """Median, 90th percentile and slowest decode step (ms): a uniform slowdown against a few
    stalls."""
    if not steps_s:
        return {"step_p50_ms": None, "step_p90_ms": None, "step_max_ms": None}
    ms = sorted(1e3 * s for s in steps_s)
    return {
        "step_p50_ms": statistics.median(ms),
        "step_p90_ms": ms[min(len(ms) - 1, int(0.9 * len(ms)))],
        "step_max_ms": ms[-1],
    }


ALLOCATOR_KEYS = ("num_alloc_retries", "num_device_alloc", "num_device_free")


def _allocator() -> dict:
    """torch's caching-allocator counters (CUDA): a retry frees cached blocks and syncs, and a
    device alloc or free is a driver call; on a nearly full device either could slow a turn."""
    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats()
    return {k: stats.get(k, 0) for k in ALLOCATOR_KEYS}


class TurnRun:
    """One request alone in the engine, run in parts: `start` (submit, steps to the first
    token), `decode(steps)` (until done), `finish` (the turn's row). `tick()` runs before each
    step (the simulated other program's turn); `watch` reports a long turn; `profile`
    (cProfile) runs around the decode steps, `prefill_profile` around the steps to the first
    token."""

    def __init__(
        self, engine: Engine, ids: list[int], n_decode: int, tick=None,
        watch: TurnWatch | None = None, turn: int = 0, profile: cProfile.Profile | None = None,
        prefill_profile: cProfile.Profile | None = None,
    ) -> None:  # fmt: skip
        self.engine, self.ids, self.n_decode, self.turn = engine, ids, n_decode, turn
        self.tick = tick or (lambda: None)
        self.watch, self.profile, self.prefill_profile = watch, profile, prefill_profile
        self.failed: str | None = None
        self.rid = None
        self.steps_s: list[float] = []  # host time of each decode step (graphs replay async)
        self.decode_s = 0.0  # the engine's own decode time: its blocks, each synchronized
        self.gc_clock = GcClock()
        self._before = self._allocator = None

    @property
    def done(self) -> bool:
        return self.failed is not None or not self.engine.has_unfinished()

    def start(self) -> TurnRun:
        """Submit the prompt and step to its first token."""
        sp = SamplingParams(max_tokens=self.n_decode, temperature=0, ignore_eos=True)
        try:
            # An anchor at the prompt's end: a hybrid model checkpoints its recurrent state
            # there, so the next turn (this history plus more) resumes from it.
            self.rid = self.engine.submit(self.ids, sp, anchors=[len(self.ids)])
        except InvalidRequestError as e:
            self.failed = f"refused: {e}"
            return self
        req = self.engine._requests[self.rid]
        self._allocator = _allocator()
        if self.watch is not None:
            self.watch.start(self.turn, self.rid)
        with self._guarded(), _enabled(self.prefill_profile):
            while self.engine.has_unfinished() and not req.output_ids:
                self._step()
        self._before = _counters(self.engine)
        return self

    def decode(self, max_steps: int | None = None) -> None:
        """Up to `max_steps` decode steps (all that are left: None), then a device synchronize:
        the block's device work is counted in this turn, not in the next engine's (under
        overlap scheduling the step in flight is completed first, so the block ends idle)."""
        n = 0
        t0 = time.perf_counter()
        with self._guarded(), self.gc_clock, _enabled(self.profile):
            while not self.done and (max_steps is None or n < max_steps):
                s0, launched = time.perf_counter(), self.engine.runner.launched
                self._step()
                spent = time.perf_counter() - s0
                if self.engine.runner.launched > launched or not self.steps_s:
                    self.steps_s.append(spent)
                else:  # overlap's last call reads the last step and launches none: its tail
                    self.steps_s[-1] += spent
                n += 1
            self.engine.overlap.drain()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        self.decode_s += time.perf_counter() - t0

    def _step(self) -> None:
        self.tick()
        if self.watch is not None:
            self.watch.beat()
        self.engine.step()

    @contextlib.contextmanager
    def _guarded(self):
        """A turn that breaks is a result, not a crash: the request is dropped, the row says
        why, and the session goes on."""
        if self.failed is not None:
            yield
            return
        try:
            yield
        except Exception as e:  # noqa: BLE001
            self.engine.release(self.rid)
            self.failed = f"{type(e).__name__}: {e}"

    def finish(self) -> dict:
        """The turn's row (its request collected from the engine)."""
        if self.watch is not None and self.rid is not None:
            self.watch.stop()
        if self.failed is not None:
            return {"failed": self.failed}
        if not self.done:
            self.decode()
            if self.failed is not None:
                return {"failed": self.failed}
        deltas = (a - b for a, b in zip(_counters(self.engine), self._before, strict=True))
        experts, hits, fetched, on_cpu, safe_point_s, wait_s, missed_layers, reruns = deltas
        out = self.engine._collect(self.rid)
        st, steps = out.stats, max(1, len(out.token_ids) - 1)
        row = {
            "reused_tokens": st["reused_tokens"],
            "prefilled_tokens": st["prefilled_tokens"],
            "ttft_s": st["ttft_s"],
            # Own decode time: the engine's clock (first token to finish) also holds whatever
            # ran between this turn's blocks. Alone in a session the two agree.
            "decode_tok_s": steps / self.decode_s if self.decode_s > 0 else None,
            "engine_decode_tok_s": st["decode_tok_s"],
            "decoded": len(out.token_ids),
            "preempted": st["preempted"],
            "miss_rate": 1 - hits / experts if experts else None,
            "experts_per_token": experts / steps,
            # Where the misses went (filled into slots, run on the CPU) and what the memory
            # manager's safe points cost, per decode step: what separates two splits' tok/s.
            "fetched_per_token": fetched / steps,
            "on_cpu_per_token": on_cpu / steps,
            "safe_point_ms": 1e3 * safe_point_s / steps,
            "step_ms": 1e3 * self.decode_s / steps,
            "device_wait_ms": 1e3 * wait_s / steps,
            "missed_layers_per_step": missed_layers / steps,
            "reruns_per_step": reruns / steps,
            **step_spread(self.steps_s),
            "gc_ms": 1e3 * self.gc_clock.seconds,
            "gc_collections": self.gc_clock.collections,
            **{k: v - self._allocator[k] for k, v in _allocator().items()},
            "answer": out.token_ids,
        }
        if out.finish_reason == "error":
            row["failed"] = f"error: {out.error}"
        elif len(out.token_ids) < self.n_decode:
            row["failed"] = (
                f"{out.finish_reason} after {len(out.token_ids)} of {self.n_decode} tokens"
            )
        return row


def run_turn(engine: Engine, ids: list[int], n_decode: int, tick=None,
             watch: TurnWatch | None = None, turn: int = 0,
             profile: cProfile.Profile | None = None,
             prefill_profile: cProfile.Profile | None = None) -> dict:  # fmt: skip
    """A whole turn at once (TurnRun's parts back to back)."""
    run = TurnRun(engine, ids, n_decode, tick, watch, turn, profile, prefill_profile).start()
    run.decode()
    return run.finish()
