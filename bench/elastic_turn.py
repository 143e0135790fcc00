"""bench/elastic.py's host profile rows and an engine's warm-up (turns themselves:
bench/turn_run.py)."""

from __future__ import annotations

import cProfile
import pstats
import random
import time
from pathlib import Path

from freetoken_agent.bench.turn_run import run_turn
from freetoken_agent.engine.engine import Engine


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
