"""One engine's session in bench/elastic.py (`run_engine`), all engines' sessions turn by turn
(`run_interleaved`), and the profiled turn after a session (`profile_last`)."""

from __future__ import annotations

import cProfile
import random
import time

from freetoken_agent.bench.elastic_engines import build, install_routing
from freetoken_agent.bench.elastic_pressure import Pressure, memory_row
from freetoken_agent.bench.elastic_rows import Limits, print_row
from freetoken_agent.bench.elastic_turn import host_profile, run_turn, warm_up
from freetoken_agent.bench.turn_watch import TurnWatch
from freetoken_agent.engine.engine import Engine


def run_engine(args, name: str, turns, limits: Limits, entry: dict, save) -> Engine | None:
    """The session on one engine into entry["turns"] (saved after each turn), another program
    beside it (entry["pressure"])."""
    t0 = time.perf_counter()
    try:
        engine = build(args, name, turns)
        install_routing(engine, args)
    except Exception as e:  # noqa: BLE001 - a split that cannot be built fails every turn
        entry["build_error"] = f"{type(e).__name__}: {e}"
        engine = None
    entry["build_s"] = time.perf_counter() - t0
    pressure = None
    if engine is not None:
        entry["warmup"] = warm_up(engine, args)
        entry["warmup"]["compiles"] = args.compiles.take()
        entry["pressure"] = {}
        try:
            pressure = Pressure(args, engine, entry["pressure"])
        except Exception as e:  # noqa: BLE001 - recorded: the session runs without pressure
            entry["pressure"]["error"] = f"{type(e).__name__}: {e}"
    history: list[int] = []
    try:
        for t, (_, new, answer) in enumerate(turns, start=1):
            ids = history + new
            row = {"turn": t, "context": len(ids), "pressure": False}
            if engine is None:
                row["failed"] = f"not built: {entry['build_error']}"
            else:
                if pressure is not None:
                    pressure.before_turn(t)
                    row["pressure"] = pressure.active
                tick = pressure.tick if pressure is not None else None
                watch = TurnWatch(engine, args.heartbeat_s, args.stall_s)
                args.compiles.take()  # between turns (the other program's polls): not timed
                row.update(run_turn(engine, ids, args.decode_tokens, tick, watch, t))
                # Triton variants built inside the turn (each one is seconds of TTFT or decode)
                row["compiles"] = [(c["kernel"], c["seconds"]) for c in args.compiles.take()]
                if pressure is not None:
                    pressure.after_turn(t)
                memory_row(row, engine, args, pressure)
                if engine.memory is not None:
                    entry["memory_trace"] = engine.memory.trace.to_json()
                limits.add(row, engine, len(ids), args.chunk)
            got = row.pop("answer", None)
            history = ids + (got if "failed" not in row and got else answer)
            entry["turns"].append(row)
            print_row(name, row)
            save()
        if engine is not None and args.profile_top > 0:
            entry["decode_profile"] = profile_last(engine, ids, args, name)
            save()
    finally:
        if pressure is not None:
            pressure.close()
    return engine


def profile_last(engine: Engine, ids: list[int], args, name: str) -> dict:
    """One turn past the session (not in its figures): the last turn's prompt with its last
    chunk of tokens drawn afresh (its prefix cached: one long-context chunk to prefill), under
    cProfile. Where two engines' steps differ on the host, this says which functions differ."""
    rng = random.Random(args.seed + 7)
    keep = max(0, len(ids) - args.chunk)
    ids = ids[:keep] + [rng.randrange(3, args.vocab) for _ in range(len(ids) - keep)]
    pre, dec = cProfile.Profile(), cProfile.Profile()
    row = run_turn(engine, ids, args.decode_tokens, profile=dec, prefill_profile=pre)
    if "failed" in row:
        return {"failed": row["failed"]}
    keys = ("prefilled_tokens", "ttft_s", "step_ms", "step_p50_ms", "step_max_ms", "gc_ms")
    out = {"context": len(ids), **{k: row.get(k) for k in (*keys, "safe_point_ms")}}
    out["decode_top"] = host_profile(dec, max(1, row["decoded"] - 1), args.profile_top)
    out["prefill_top"] = host_profile(pre, 1, args.profile_top)
    print(
        f"prof {name:<11} ttft {row['ttft_s']:.3f} s ({row['prefilled_tokens']} tokens), "
        f"decode step {row['step_ms']:.2f} ms (p50 {row['step_p50_ms']:.2f})"
    )
    for what in ("decode", "prefill"):
        unit = "us/step" if what == "decode" else "us"
        for r in out[f"{what}_top"][:10]:
            print(f"prof {name:<11} {what:<8}{r['own_us_per_step']:9.0f} {unit:<8}"
                  f"{r['calls_per_step']:8.1f}x  {r['function']}")  # fmt: skip
    return out
