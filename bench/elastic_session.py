"""One engine's session in bench/elastic.py (`run_engine`), all engines' sessions turn by turn
(`run_interleaved`), and the profiled turn after a session (`profile_last`)."""

from __future__ import annotations

import cProfile
import random
import time

from freetoken_agent.bench.elastic_engines import build, install_routing
from freetoken_agent.bench.elastic_pressure import Pressure, memory_row
from freetoken_agent.bench.elastic_rows import Limits, print_row
from freetoken_agent.bench.elastic_turn import host_profile, warm_up
from freetoken_agent.bench.turn_run import TurnRun, run_turn
from freetoken_agent.bench.turn_watch import TurnWatch
from freetoken_agent.engine.engine import Engine


def run_engine(args, name: str, turns, limits: Limits, entry: dict, save) -> Engine | None:
    """The session on one engine into entry["turns"] (saved after each turn), another program
    beside it (entry["pressure"])."""
    engine = _built(args, name, turns, entry)
    pressure = None
    if engine is not None:
        entry["pressure"] = {}
        try:
            pressure = Pressure(args, engine, entry["pressure"])
        except Exception as e:  # noqa: BLE001 - recorded: the session runs without pressure
            entry["pressure"]["error"] = f"{type(e).__name__}: {e}"
    history: list[int] = []
    try:
        for t, (_, new, answer) in enumerate(turns, start=1):
            ids = history + new
            if pressure is not None:
                pressure.before_turn(t)
            turn = SessionTurn(args, t, ids, engine, entry, pressure, polls=True)
            turn.decode(None)
            row = turn.finish(limits)
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


def _built(args, name: str, turns, entry: dict) -> Engine | None:
    """An engine of the session, warmed up; None (and entry["build_error"]) if it cannot be."""
    t0 = time.perf_counter()
    try:
        engine = build(args, name, turns)
        install_routing(engine, args)
    except Exception as e:  # noqa: BLE001 - a split that cannot be built fails every turn
        entry["build_error"] = f"{type(e).__name__}: {e}"
        engine = None
    entry["build_s"] = time.perf_counter() - t0
    if engine is not None:
        entry["warmup"] = warm_up(engine, args)
        entry["warmup"]["compiles"] = args.compiles.take()
    return engine


def run_interleaved(args, names, turns, limits: Limits, report: dict, save) -> dict:
    """Every engine alive at once and the session run turn by turn: each turn is prefilled on
    every engine, forward on odd turns and backward on even ones, then decoded on all of them
    in alternating blocks of `args.interleave_block` steps (0: each engine's decode whole), the
    first engine of each round rotating. One engine alone swung ±10% from turn to turn on the
    device (the machine's speed drifts), more than the differences between the splits; and
    within a session the host's speed switches between two levels for seconds at a time
    (tenth session: a step's host time ~6.5 or ~10.5 ms in every engine alike), so even
    turns run back to back compared the levels as much as the splits. One other program
    beside them all, its take polled on the elastic engine (the one that follows free
    memory; else the first built): the fixed splits keep what they hold, as in a run of their
    own. Returns the engines by name."""
    entries = {n: report["engines"].setdefault(n, {"turns": []}) for n in names}
    engines = {n: _built(args, n, turns, entries[n]) for n in names}
    lead_name = next((n for n in ("elastic", *names) if engines.get(n) is not None), None)
    lead = engines.get(lead_name)
    pressure, record = None, {}
    if lead is not None:
        try:
            pressure = Pressure(args, lead, record)
        except Exception as e:  # noqa: BLE001 - recorded: the session runs without pressure
            record["error"] = f"{type(e).__name__}: {e}"
    for n in names:  # what the other program got is the lead's record; the others share it
        entries[n]["pressure"] = record if n == lead_name else {"shared_with": lead_name}
    histories: dict[str, list[int]] = {n: [] for n in names}
    last: dict[str, list[int]] = {}
    try:
        for t, (_, new, answer) in enumerate(turns, start=1):
            if pressure is not None:
                pressure.before_turn(t)
            order = names if t % 2 else names[::-1]
            runs = {}
            for name in order:
                ids = last[name] = histories[name] + new
                runs[name] = SessionTurn(args, t, ids, engines[name], entries[name], pressure,
                                         engines[name] is lead)  # fmt: skip
            _decode_in_blocks([runs[name] for name in order], args.interleave_block or None)
            for name in order:
                row = runs[name].finish(limits)
                got = row.pop("answer", None)
                histories[name] = last[name] + (got if "failed" not in row and got else answer)
                entries[name]["turns"].append(row)
                print_row(name, row)
            save()
        if args.profile_top > 0:
            for name in names:
                if engines[name] is not None and name in last:
                    entries[name]["decode_profile"] = profile_last(engines[name], last[name],
                                                                   args, name)  # fmt: skip
                    save()
    finally:
        if pressure is not None:
            pressure.close()
    return engines


def _decode_in_blocks(runs: list[SessionTurn], block: int | None) -> None:
    """Decode every run to its end, `block` steps of each in turn (None: each whole), the
    first run of each round rotating so that no engine always follows the same one."""
    rounds = 0
    while not all(run.done for run in runs):
        k = rounds % len(runs)
        for run in runs[k:] + runs[:k]:
            if not run.done:
                run.decode(block)
        rounds += 1


class SessionTurn:
    """One engine's turn `t` of the session (run_engine, run_interleaved), the other program's
    `before_turn` already called; `polls`: the engine the other program's take is stepped and
    polled on. Created: prefilled to the first token; `decode(steps)`; `finish` -> the row."""

    def __init__(self, args, t: int, ids, engine, entry: dict, pressure, polls: bool) -> None:
        self.args, self.t, self.engine, self.entry, self.pressure = args, t, engine, entry, pressure
        self.row = {"turn": t, "context": len(ids), "pressure": bool(pressure and pressure.active)}
        self.compiles: list[dict] = []
        self.polls = polls and pressure is not None
        self.run = None
        if engine is None:
            self.row["failed"] = f"not built: {entry['build_error']}"
            return
        tick = pressure.tick if self.polls else None
        watch = TurnWatch(engine, args.heartbeat_s, args.stall_s)
        args.compiles.take()  # between turns (the other program's polls): not timed
        self.run = TurnRun(engine, ids, args.decode_tokens, tick, watch, t).start()
        self.compiles += args.compiles.take()

    @property
    def done(self) -> bool:
        return self.run is None or self.run.done

    def decode(self, steps: int | None) -> None:
        if self.run is not None:  # an engine that could not be built has no turn to decode
            self.run.decode(steps)
            self.compiles += self.args.compiles.take()

    def finish(self, limits: Limits) -> dict:
        row = self.row
        if self.run is None:
            return row
        row.update(self.run.finish())
        # Triton variants built inside the turn (each one is seconds of TTFT or decode)
        row["compiles"] = [(c["kernel"], c["seconds"]) for c in self.compiles]
        if self.polls:
            self.pressure.after_turn(self.t)
        memory_row(row, self.engine, self.args, self.pressure)
        if self.engine.memory is not None:
            self.entry["memory_trace"] = self.engine.memory.trace.to_json()
        limits.add(row, self.engine, row["context"], self.args.chunk)
        return row
