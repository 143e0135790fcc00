"""Where a decode step's host time goes, elastic engine against a fixed split (a diagnosis, not
a target: the elastic bench showed elastic decode 0-10% slower than fixed-last on the hybrid
shape with more slots and fewer fills, and offloaded decode is host-bound there).

    python -m freetoken_agent.bench.decode_profile [--layers 8] [--budget-gb 9] [--tokens 64]
        [--fixed-kv-tokens N] [--squeeze-gb G] [--hog-gb G]
    python -m freetoken_agent.bench.decode_profile --cpu-smoke

Both engines share one host pool and run the same prompt (--context tokens, then --tokens
decoded, routing zipf:1.0,loc:0.7 as the elastic bench); the fixed split's KV holds
--fixed-kv-tokens (default: the context; the elastic bench's fixed-last holds its last turn).
Per engine: the step's wall time and the memory manager's share (a turn without profilers),
the top functions by own time under cProfile (a second turn), and on CUDA the device time of
each kernel under torch.profiler (a third): host overhead and kernel time, told apart.
--squeeze-gb cuts and restores the elastic budget through set_gpu_budget; --hog-gb has another
process take and free that much (the elastic bench's pressure), then times decode and the
host's wait on the device again: after pressure the elastic bench's decode stayed slower."""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import random
import time
from collections import Counter
from types import SimpleNamespace

import torch

from freetoken_agent.bench.elastic_engines import build, install_routing, shape_config
from freetoken_agent.bench.turn_run import run_turn


def _turn(engine, ids: list[int], n: int, prefill_ctx=None, decode_ctx=None) -> tuple[float, float]:
    """Prefill `ids` (inside `prefill_ctx`), then decode `n` tokens (inside `decode_ctx`);
    returns (ms to the first token, ms per decode step)."""
    from freetoken_agent.engine.sampling_params import SamplingParams

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    with prefill_ctx or contextlib.nullcontext():
        rid = engine.submit(ids, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        req = engine._requests[rid]
        while engine.has_unfinished() and not req.output_ids:
            engine.step()
        sync()
    t1 = time.perf_counter()
    with decode_ctx or contextlib.nullcontext():
        while engine.has_unfinished():
            engine.step()
        sync()
    t2 = time.perf_counter()
    engine._collect(rid)
    return 1e3 * (t1 - t0), 1e3 * (t2 - t1) / max(1, n - 1)


def _kernel_table(prof, per: int, top: int, what: str) -> None:
    """Device time per kernel under torch.profiler, divided by `per` (steps or 1)."""
    from freetoken_agent.bench.step_kernels import kernel_rows

    total, rows = kernel_rows(prof.key_averages(), per, 1)
    print(f"-- {what}: device time {total / 1e3:.2f} ms; top kernels (us, calls):")
    for r in rows[:top]:
        print(f"{r['us_per_step']:11.1f} {r['launches_per_step']:8.1f}  {r['kernel'][:90]}")


def _kernels(engine, ids: list[int], a) -> None:
    """Kernel times of a fresh prompt's prefill (whole) and its decode steps (per step)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    pre, dec = profile(activities=acts), profile(activities=acts)
    _turn(engine, ids, a.tokens, pre, dec)
    _kernel_table(pre, 1, a.top, "prefill")
    _kernel_table(dec, a.tokens - 1, a.top, "decode, per step")


def _squeeze(engine, nbytes: int, ids: list[int], a, before: float) -> None:
    """Cut the elastic budget by `nbytes` for a turn, give it back, and time decode again."""
    memory, rng = engine.memory, random.Random(2)
    budget, slots = memory.budget, engine.loaded.bank.cache.n_slots
    engine.set_gpu_budget(budget - nbytes)
    n = min(512, len(ids) // 2)  # short turns of fresh tokens, under each budget
    _turn(engine, rng.choices(ids, k=n), 8)
    squeezed = engine.loaded.bank.cache.n_slots
    engine.set_gpu_budget(budget)
    _turn(engine, rng.choices(ids, k=n), 8)
    _, after = _turn(engine, ids[::3] + ids[1::3], a.tokens)
    regrown = engine.loaded.bank.cache.n_slots
    print(f"-- squeeze {nbytes / 1e9:.1f} GB: slots {slots} -> {squeezed} -> {regrown}; "
          f"decode {before:.2f} -> {after:.2f} ms/step")  # fmt: skip


def _hog_squeeze(engine, nbytes: int, ids: list[int], a, before: tuple[float, float]) -> None:
    """As the elastic bench's pressure turns: another process (bench/vram_hog.py, beside a
    ballast that leaves the engine no spare memory) takes `nbytes` while a turn runs, then
    frees them; decode is timed again, with the host's wait on the device per step, and the
    kernels after. Does decode stay slower once the budget is back (the elastic bench's
    post-pressure turns were 8 of 8 slower than fixed-last in three runs)?"""
    from freetoken_agent.bench.elastic_pressure import Pressure

    rng, record = random.Random(3), {}
    args = SimpleNamespace(cpu_smoke=a.cpu_smoke, headroom=int(0.5e9), pressure_turn=1,
                           pressure_turns=1, pressure_bytes=nbytes, pressure_timeout_s=15.0,
                           budget=a.budget, smoke_reserve=a.smoke_reserve)  # fmt: skip
    if a.cpu_smoke:  # the simulated device (bench/simulated_device.py), as the elastic bench's
        args.headroom = a.smoke_reserve // 2
    pressure = Pressure(args, engine, record)
    try:
        slots, n = engine.loaded.bank.cache.n_slots, min(512, len(ids) // 2)
        pressure.before_turn(1)  # the take, stepped by the turn's ticks (simulated device)
        run_turn(engine, rng.choices(ids, k=n), 8, tick=pressure.tick)
        pressure.after_turn(1)
        squeezed = engine.loaded.bank.cache.n_slots
        pressure.before_turn(2)  # the release, polled until the budget is back
        run_turn(engine, rng.choices(ids, k=n), 8)
        after = _timed(engine, ids[::3] + ids[1::3], a.tokens)
    finally:
        pressure.close()
    print(
        f"-- hog {nbytes / 1e9:.3g} GB (got {record.get('got', 0) / 1e9:.3g}): slots {slots} -> "
        f"{squeezed} -> {engine.loaded.bank.cache.n_slots}; decode {before[0]:.2f} -> "
        f"{after[0]:.2f} ms/step, waiting on the device {before[1]:.2f} -> {after[1]:.2f}"
    )
    if torch.cuda.is_available():
        _kernels(engine, ids[1::2] + ids[::2], a)


def _timed(engine, ids: list[int], n: int) -> tuple[float, float]:
    """(ms per decode step, of which ms the host waited on the device's routing)."""
    graphs = engine.runner.graphs
    w0 = getattr(graphs, "wait_s", 0.0)
    _, wall = _turn(engine, ids, n)
    return wall, 1e3 * (getattr(graphs, "wait_s", 0.0) - w0) / max(1, n - 1)


def _prefill_counters(engine) -> dict[str, float]:
    """What a prefill moved: layers streamed, bytes over PCIe, split
    changes, slots (elastic and fixed prefill differ by ~1 s at 32k on the device; the device
    time of both is the same)."""
    bank, memory = engine.loaded.bank, engine.memory
    s = getattr(bank, "streamer", None)
    return {
        "layers": s.layers_streamed if s else 0,
        "h2d": s.bytes_h2d if s else 0,
        "changes": len(memory.trace) if memory is not None else 0,
        "map_failures": memory.map_failures if memory is not None else 0,
        "slots": bank.cache.n_slots if s else 0,
    }


def _prefill_delta(engine, before: dict[str, float]) -> str:
    after = _prefill_counters(engine)
    d = {k: after[k] - before[k] for k in before}
    reasons = ""
    if d["changes"]:  # the trace keeps its latest records: these are the prefill's
        counts = Counter(r.reason for r in engine.memory.trace.records[-d["changes"] :])
        reasons = " (" + ", ".join(f"{n}x {why}" for why, n in counts.most_common()) + ")"
    return (
        f"{d['layers']} layers streamed, {d['h2d'] / 1e9:.2f} GB host-to-device, "
        f"{d['changes']} split changes{reasons}, "
        f"{d['map_failures']} refused maps, slots {before['slots']} -> {after['slots']}"
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--budget-gb", type=float, default=9.0)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--fixed-kv-tokens", type=int, default=None)
    ap.add_argument("--policy", default="adaptive", help="offload policy of both engines")
    ap.add_argument("--hybrid-run-ahead", action="store_true",
                    help="both engines: segmented decode runs ahead (recurrent_shadow.py)",
                    )  # fmt: skip
    ap.add_argument("--squeeze-gb", type=float, default=0.0,
                    help="elastic only: cut the budget by this much for a turn, restore it, and "
                    "decode again (does a shrink and regrow leave decode slower?)")  # fmt: skip
    ap.add_argument("--hog-gb", type=float, default=0.0,
                    help="another process takes this much for a turn and frees it (--cpu-smoke: "
                    "a quarter of the simulated arena); "
                    "decode (and its wait on the device) is timed again, kernels after",
                    )  # fmt: skip
    ap.add_argument("--cpu-smoke", action="store_true")
    a = ap.parse_args(argv)
    args = SimpleNamespace(
        shape="qwen3.6-35b-a3b", layers=a.layers, cpu_smoke=a.cpu_smoke, chunk=8192,
        decode_tokens=a.tokens, budget=int(a.budget_gb * 1e9), policy=a.policy, pool=None,
        hybrid_run_ahead=a.hybrid_run_ahead,
        routing="zipf:1.0,loc:0.7", seed=0, smoke_group=1 << 16,
    )  # fmt: skip
    cfg, args.stream_min = shape_config(args)
    a.budget, a.smoke_reserve = args.budget, 0  # the hog's (the reserve is the smoke's only)
    if a.cpu_smoke:
        from freetoken_agent.bench.elastic_engines import smoke_budget

        args.chunk, args.start_tokens = 128, a.context
        args.budget, arena = smoke_budget(cfg, args)
        args.smoke_group = arena // 16
        a.budget, a.smoke_reserve = args.budget, arena // 8
    args.cfg = {**cfg, "max_position_embeddings": max(4096, 2 * a.context + 64)}
    args.vocab = args.cfg["vocab_size"]
    turns = [(a.context, None, None), (a.fixed_kv_tokens or a.context, None, None)]
    rng = random.Random(1)
    ids = [rng.randrange(3, args.vocab) for _ in range(a.context)]
    for name in ("elastic", "fixed-last"):
        engine = build(args, name, turns)
        install_routing(engine, args)
        # Warm: a fresh prompt of two whole prefill chunks (what the context allows) compiles
        # what the timed turn runs: the streamed layers, the chunked scans, and the variants of
        # a chunk after a prefix. A 300-token warm-up had left all of it to the first engine's
        # timed prefill (11.8 s against 4.7 s for the engine after it), one chunk the prefix
        # variants (16k at 8 layers: 5.4 s against 0.49 s, tenth session).
        n = min(2 * args.chunk, engine.max_model_len - 4)
        run_turn(engine, [rng.randrange(3, args.vocab) for _ in range(n)], 2)
        memory = engine.memory
        sp0 = memory.safe_point_s if memory is not None else 0.0
        before = _prefill_counters(engine)
        ttft, wall = _turn(engine, ids, a.tokens)
        print(f"-- {name} prefill of {len(ids)} tokens: {_prefill_delta(engine, before)}")
        sp = 1e3 * ((memory.safe_point_s if memory is not None else 0.0) - sp0) / (a.tokens - 1)
        if a.squeeze_gb and memory is not None:
            _squeeze(engine, int(a.squeeze_gb * 1e9), ids, a, wall)
        if a.hog_gb:
            nbytes = arena // 4 if a.cpu_smoke else int(a.hog_gb * 1e9)
            _hog_squeeze(engine, nbytes, ids, a, _timed(engine, ids[::-1], a.tokens))
        pre, dec = cProfile.Profile(), cProfile.Profile()
        ttft_p, profiled = _turn(engine, ids[::-1], a.tokens, pre, dec)  # a Profile enables itself
        slots = engine.loaded.bank.cache.n_slots
        print(
            f"== {name}: prefill {ttft:.0f} ms, decode {wall:.2f} ms/step (safe points in both "
            f"{sp:.2f}; under cProfile {ttft_p:.0f} ms, {profiled:.2f}), {slots} slots"
        )
        for what, prof in (("decode", dec), ("prefill", pre)):
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(a.top)
            print(f"-- {what}, host functions by own time:")
            print("\n".join(out.getvalue().splitlines()[6:]))
        if torch.cuda.is_available():
            t0 = time.perf_counter()
            for _ in range(20):  # the budget watcher's read (every memory_poll_s)
                torch.cuda.mem_get_info()
            print(f"-- mem_get_info {1e6 * (time.perf_counter() - t0) / 20:.0f} us a call")
            _kernels(engine, ids[1::2] + ids[::2], a)
        del engine
        torch.cuda.empty_cache() if torch.cuda.is_available() else None


if __name__ == "__main__":
    main()
