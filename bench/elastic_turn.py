"""One turn of bench/elastic.py's session on one engine, and the engine's warm-up: a request alone
in the engine, its decode counters taken from its first token on."""

from __future__ import annotations

import contextlib
import cProfile
import gc
import pstats
import random
import statistics
import time
from pathlib import Path

import torch

from freetoken_agent.bench.turn_watch import TurnWatch
from freetoken_agent.engine.engine import Engine
from freetoken_agent.engine.outputs import InvalidRequestError
from freetoken_agent.engine.sampling_params import SamplingParams


def _counters(engine: Engine) -> tuple[float, ...]:
    """(experts, hits, fetched, on_cpu, safe-point seconds, routing-wait seconds, layers with a
    miss, segments rerun, wall seconds) so far. The routing wait: host time blocked on the
    device inside segmented decode graphs, so a slower step is told device-bound (it grows)
    from host-bound (it does not). A layer with a miss stops the step for the host (the same
    misses spread over more layers cost more stops)."""
    st = getattr(engine.loaded.bank, "stats", None)
    bank = (st.experts, st.hits, st.fetched, st.on_cpu) if st is not None else (0, 0, 0, 0)
    memory = engine.memory.safe_point_s if engine.memory is not None else 0.0
    graphs = engine.runner.graphs
    wait = getattr(graphs, "wait_s", 0.0)
    stalls = (getattr(graphs, "missed_layers", 0), getattr(graphs, "reruns", 0))
    return (*bank, memory, wait, *stalls, time.perf_counter())


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


def host_profile(prof: cProfile.Profile, steps: int, top: int = 25) -> list[dict]:
    """The `top` functions by own time under `prof`, per step (us; a prefill: steps=1)."""
    stats = pstats.Stats(prof).stats  # {(file, line, name): (calls, ncalls, own, cum, ...)}
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    return [
        {
            "function": f"{Path(file).name}:{line}({name})",
            "calls_per_step": ncalls / steps,
            "own_us_per_step": 1e6 * own / steps,
            "cum_us_per_step": 1e6 * cum / steps,
        }
        for (file, line, name), (_, ncalls, own, cum, _) in rows
    ]


ALLOCATOR_KEYS = ("num_alloc_retries", "num_device_alloc", "num_device_free")


def _allocator() -> dict:
    """torch's caching-allocator counters (CUDA): a retry frees cached blocks and syncs, and a
    device alloc or free is a driver call; on a nearly full device either could slow a turn."""
    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats()
    return {k: stats.get(k, 0) for k in ALLOCATOR_KEYS}


def run_turn(
    engine: Engine, ids: list[int], n_decode: int, tick=None, watch: TurnWatch | None = None,
    turn: int = 0, profile: cProfile.Profile | None = None,
    prefill_profile: cProfile.Profile | None = None,
) -> dict:  # fmt: skip
    """One request alone in the engine; decode counters from its first token on. `tick()`
    runs before each step (the simulated other program's turn); `watch` reports a long turn;
    `profile` (cProfile) runs around the decode steps, `prefill_profile` around the steps to
    the first token."""
    tick = tick or (lambda: None)
    sp = SamplingParams(max_tokens=n_decode, temperature=0, ignore_eos=True)
    try:
        # An anchor at the prompt's end: a hybrid model checkpoints its recurrent state there,
        # so the next turn (this history plus more) resumes from it (attention: ignored).
        rid = engine.submit(ids, sp, anchors=[len(ids)])
    except InvalidRequestError as e:
        return {"failed": f"refused: {e}"}
    req = engine._requests[rid]
    allocator = _allocator()
    if watch is not None:
        watch.start(turn, rid)
        beat = watch.beat
    else:
        beat = lambda: None  # noqa: E731
    try:
        with _enabled(prefill_profile):
            while engine.has_unfinished() and not req.output_ids:
                tick()
                beat()
                engine.step()
        before = _counters(engine)
        steps_s: list[float] = []  # host time of each decode step (graphs replay async)
        with GcClock() as gc_clock, _enabled(profile):
            while engine.has_unfinished():
                tick()
                beat()
                t0 = time.perf_counter()
                engine.step()
                steps_s.append(time.perf_counter() - t0)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - a turn that breaks is a result, not a crash
        engine.abort(rid)
        engine._pop(rid)
        return {"failed": f"{type(e).__name__}: {e}"}
    finally:
        if watch is not None:
            watch.stop()
    deltas = (a - b for a, b in zip(_counters(engine), before, strict=True))
    experts, hits, fetched, on_cpu, safe_point_s, wait_s, missed_layers, reruns, wall_s = deltas
    out = engine._collect(rid)
    st = out.stats
    row = {
        "reused_tokens": st["reused_tokens"],
        "prefilled_tokens": st["prefilled_tokens"],
        "ttft_s": st["ttft_s"],
        "decode_tok_s": st["decode_tok_s"],
        "decoded": len(out.token_ids),
        "preempted": st["preempted"],
        "miss_rate": 1 - hits / experts if experts else None,
        "experts_per_token": experts / max(1, len(out.token_ids) - 1),
        # Where the misses went (filled into slots, run on the CPU) and what the memory
        # manager's safe points cost, per decode step: what separates two splits' tok/s.
        "fetched_per_token": fetched / max(1, len(out.token_ids) - 1),
        "on_cpu_per_token": on_cpu / max(1, len(out.token_ids) - 1),
        "safe_point_ms": 1e3 * safe_point_s / max(1, len(out.token_ids) - 1),
        "step_ms": 1e3 * wall_s / max(1, len(out.token_ids) - 1),
        "device_wait_ms": 1e3 * wait_s / max(1, len(out.token_ids) - 1),
        "missed_layers_per_step": missed_layers / max(1, len(out.token_ids) - 1),
        "reruns_per_step": reruns / max(1, len(out.token_ids) - 1),
        **step_spread(steps_s),
        "gc_ms": 1e3 * gc_clock.seconds,
        "gc_collections": gc_clock.collections,
        **{k: v - allocator[k] for k, v in _allocator().items()},
        "answer": out.token_ids,
    }
    if out.finish_reason == "error":
        row["failed"] = f"error: {out.error}"
    elif len(out.token_ids) < n_decode:
        row["failed"] = f"{out.finish_reason} after {len(out.token_ids)} of {n_decode} tokens"
    return row


def warm_up(engine: Engine, args) -> dict:
    """One prompt of a prefill chunk and a short one (or what the engine's KV holds), and two
    decoded tokens: kernels compiled, and the allocator holding its working memory before the
    other program measures what is free."""
    rng = random.Random(args.seed + 1)
    # A full chunk (streamed) and a short one (200 tokens: below the bench's stream_min_tokens,
    # the cache path): both compiled before timing.
    n = max(1, min(args.chunk + 200, engine.max_model_len - 4))
    t0 = time.perf_counter()
    row = run_turn(engine, [rng.randrange(3, args.vocab) for _ in range(n)], 2)
    row.pop("answer", None)
    return {"tokens": n, "seconds": time.perf_counter() - t0, "failed": row.get("failed")}
