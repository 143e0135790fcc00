"""Where an offloaded decode step spends its host time: per-phase wall time per token.

    python -m freetoken_agent.bench profile-offload [--layers 12] [--budget-gb 8.59]
        [--regimes uniform native] [--policies cpu static adaptive transfer]

Builds the same random model as `bench offload`, captures segmented decode graphs, and times
(with perf_counter, on the thread that drives the step) the phases of every decode step:
waiting for a segment's routing (`wait`), the host's placement (`resolve`, of which `place`
decides, issues the fills (`fill`) and waits for the CPU branch; `cpu` is that branch on its
worker thread, `kernel` the CPU expert kernel in it; `publish` publishes the filled slots), the
trace replay (`trace`), the segments' graph launches (`launch`), and the rest of `engine.step`
(scheduling, sampling). `stops_per_step` counts the layers that stopped the step for the host;
the `stop_*_us` fields split a stop with fills into its host intervals (stop_clock.py).
Prints one JSON line per (regime, policy). `--torch-profile N` then profiles N more steps per
row with torch.profiler and prints its host-side table (self CPU time per op and CUDA runtime
call): where the time between the CPU kernel's runs goes, beyond the phases above.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import time
from collections import defaultdict

import torch

from freetoken_agent.bench.environment import ENVIRONMENT
from freetoken_agent.bench.offload import offload_engine
from freetoken_agent.bench.offload_decode import start_policy
from freetoken_agent.bench.routing_traces import Regime, TracedRouting, TraceGenerator
from freetoken_agent.bench.stop_clock import StopClock
from freetoken_agent.engine import segmented_graphs
from freetoken_agent.engine.experts import calibration, offload
from freetoken_agent.engine.sampling_params import SamplingParams
from freetoken_agent.help_format import DefaultsHelpFormatter
from freetoken_agent.kernels.cpu import experts as cpu_kernel


class Timers:
    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self.clock = StopClock()  # a stop's intervals (stop_clock.py)

    def wrap(self, obj, name: str, label: str) -> None:
        """Replace obj.name by a version that adds its wall time to `label`."""
        fn = getattr(obj, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total[label] += time.perf_counter() - start

        setattr(obj, name, timed)


class _TimedEvent:
    def __init__(self, event, timers: Timers) -> None:
        self.event, self.timers = event, timers

    def record(self, *args):
        self.event.record(*args)

    def synchronize(self):
        start = time.perf_counter()
        self.event.synchronize()
        self.timers.total["wait"] += time.perf_counter() - start
        self.timers.clock.woke()


class _TimedSegment:
    """A captured segment whose replay (the host's graph launch) is timed as `launch`."""

    def __init__(self, graph, timers: Timers) -> None:
        self.graph, self.timers = graph, timers

    def replay(self) -> None:
        self.timers.clock.launching()
        start = time.perf_counter()
        self.graph.replay()
        self.timers.total["launch"] += time.perf_counter() - start


def _host_table(engine, policy: str, steps: int, rows: int) -> str:
    """torch.profiler's host-side table over `steps` decode steps of the running requests."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            if not engine.has_unfinished():
                break
            engine.step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)
    return f"== host table, policy {policy}, {steps} steps\n{table}"


def _kernel_alone(bank, repeats: int = 50) -> dict:
    """The CPU expert kernel alone at one token: ms per call for n random pool rows."""
    pool, spec = bank.pool, bank.spec
    x = torch.randn(1, spec.hidden_size, dtype=pool.w13.dtype)
    out = {}
    for n in (1, 2, 4, 8):
        rows = torch.full((1, spec.top_k), -1, dtype=torch.long)
        weights = torch.rand(1, spec.top_k)
        times = []
        for _ in range(repeats):
            rows[0, :n] = torch.randperm(pool.n_rows)[:n]
            start = time.perf_counter()
            calibration.cpu_experts(x, pool.w13, pool.w2, rows, weights)
            times.append(time.perf_counter() - start)
        times.sort()
        ms = 1e3 * times[len(times) // 2]
        out[f"kernel_{n}_ms"] = round(ms, 4)
        out[f"kernel_{n}_gb_s"] = round(n * pool.expert_bytes / ms / 1e6, 1)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="freetoken bench profile-offload",
        description=__doc__,
        epilog=ENVIRONMENT,
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument("--layers", type=int, default=12, help="model depth (12: peer slice)")
    parser.add_argument("--budget-gb", type=float, default=8.59, help="GPU budget (GB)")
    parser.add_argument("--decode", type=int, default=48, help="decode steps timed per row")
    parser.add_argument("--batch", type=int, default=1, help="sequences decoding together")
    parser.add_argument("--chunk", type=int, default=8192, help="prefill chunk (tokens)")
    parser.add_argument("--regimes", nargs="+", default=["uniform", "native"],
                        help="routing: native (random router), uniform, zipf:S,loc:P")  # fmt: skip
    parser.add_argument("--policies", nargs="+", default=["cpu", "static", "adaptive", "transfer"],
                        help="offload policies, one row each")  # fmt: skip
    parser.add_argument(
        "--torch-profile",
        type=int,
        default=0,
        metavar="N",
        help="after each row, profile N more decode steps with torch.profiler (host table)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        nargs="+",
        default=None,
        help="CPU expert kernel threads, one set of rows per value (default: "
        "kernels/cpu/experts.py default_threads(): FREETOKEN_CPU_THREADS, else the physical "
        "cores, less one where no SMT sibling is left for the driver thread); fewer leave "
        "cores to the driver and the thread launching graphs",
    )
    parser.add_argument(
        "--run-ahead",
        type=int,
        nargs="+",
        default=None,
        help="segments queued past the one checked, one set of rows per value (default: "
        "segmented_graphs.RUN_AHEAD)",
    )
    parser.add_argument(
        "--miss-gate",
        type=float,
        nargs="+",
        default=None,
        help="run ahead past layers missing in fewer than this share of steps, one set of "
        "rows per value (default: segmented_graphs.MISS_GATE)",
    )
    parser.add_argument(
        "--fill-behind",
        type=int,
        nargs="+",
        choices=[0, 1],
        default=None,
        help="EngineConfig.fill_behind off (0) and/or on (1), one set of rows per value "
        "(default: the engine's)",
    )
    parser.add_argument(
        "--overlap",
        type=int,
        nargs="+",
        choices=[0, 1],
        default=None,
        help="EngineConfig.overlap_schedule off (0) and/or on (1), one set of rows per value "
        "(default: the engine's). Under overlap, `replay` includes the previous step's reading",
    )
    args = parser.parse_args(argv)
    engine, b_p, b_h = offload_engine(args.layers, args.budget_gb, args.chunk)
    bank, model = engine.loaded.bank, engine.loaded.model
    cores = {"physical_cores": cpu_kernel.physical_cores(), "logical_cpus": os.cpu_count()}
    print(json.dumps({"slots": bank.cache.n_slots, "b_p": b_p / 1e9, "b_h": b_h / 1e9, **cores}))
    timers = Timers()
    for name, label in (("resolve", "resolve"), ("_place", "place")):
        timers.wrap(bank, name, label)
    timers.wrap(offload, "run_on_cpu", "cpu")  # the CPU branch, as the bank calls it
    timers.wrap(bank.cache, "fill", "fill")
    timers.wrap(bank.cache, "publish", "publish")
    timers.clock.attach(bank)
    timers.wrap(calibration, "cpu_experts", "kernel")
    print(json.dumps(_kernel_alone(bank)))
    timers.wrap(engine, "step", "step")
    rng = random.Random(0)
    vocab = engine.spec.vocab_size
    for regime_name in args.regimes:
        if regime_name == "native":
            model.set_expert_bank(bank)
        else:
            gen = TraceGenerator(
                engine.spec.n_moe_layers,
                engine.spec.n_experts,
                engine.spec.top_k,
                Regime.parse(regime_name),
                seed=0,
            )
            routing = TracedRouting(bank, gen)
            timers.wrap(routing, "before_graph_step", "trace")
            model.set_expert_bank(routing)
        engine.capture_graphs()
        graphs = engine.runner.graphs
        timers.wrap(graphs, "replay", "replay")
        graphs.done = [_TimedEvent(e, timers) for e in graphs.done]
        graphs.segments = {
            bs: [_TimedSegment(g, timers) for g in segs] for bs, segs in graphs.segments.items()
        }
        variants = itertools.product(
            args.threads or [None],
            args.run_ahead or [segmented_graphs.RUN_AHEAD],
            args.miss_gate or [segmented_graphs.MISS_GATE],
            args.fill_behind or [int(bank.fill_behind)],
            args.overlap or [int(engine.overlap.enabled)],
            args.policies,
        )
        for threads, run_ahead, miss_gate, behind, overlap, policy in variants:
            cpu_kernel._threads = threads  # None: the default (cpu_kernel.default_threads)
            graphs.run_ahead, graphs.miss_gate = run_ahead, miss_gate
            bank.fill_behind = bool(behind)
            engine.overlap.enabled = bool(overlap)
            start_policy(engine, bank, policy, b_p, b_h)
            extra = args.torch_profile  # steps left for the profiler after the timed ones
            sp = SamplingParams(max_tokens=8 + args.decode + extra, temperature=0, ignore_eos=True)
            for _ in range(args.batch):
                engine.submit([rng.randrange(vocab) for _ in range(64)], sp)
            for _ in range(9):  # prefill and warm-up
                engine.step()
            if regime_name != "native":  # the traces' draws before the clock starts
                routing.reserve((args.decode + extra) * args.batch)
            torch.cuda.synchronize()
            timers.total.clear()
            timers.clock.reset()
            graphs.reruns = 0
            stops0 = graphs.missed_layers
            st0 = (bank.stats.experts, bank.stats.hits, bank.stats.fetched, bank.stats.on_cpu,
                   bank.stats.behind)  # fmt: skip
            start, steps = time.perf_counter(), 0
            while engine.has_unfinished() and steps < args.decode:
                engine.step()
                steps += 1
            torch.cuda.synchronize()
            wall = time.perf_counter() - start
            st = bank.stats
            row = {
                "regime": regime_name,
                "policy": policy,
                "threads": cpu_kernel.default_threads(),
                "run_ahead": run_ahead,
                "miss_gate": miss_gate,
                "fill_behind": bool(behind),
                "overlap": bool(overlap),
                "tok_s": args.batch * steps / wall,
                "ms_per_step": 1e3 * wall / steps,
                **{k: round(1e3 * v / steps, 3) for k, v in sorted(timers.total.items())},
                "experts_per_step": (st.experts - st0[0]) / steps,
                "hits_per_step": (st.hits - st0[1]) / steps,
                "fetched_per_step": (st.fetched - st0[2]) / steps,
                "on_cpu_per_step": (st.on_cpu - st0[3]) / steps,
                "behind_per_step": (st.behind - st0[4]) / steps,  # of fetched, and of on_cpu
                "reruns_per_step": graphs.reruns / max(steps, 1),
                "stops_per_step": (graphs.missed_layers - stops0) / max(steps, 1),
                **timers.clock.row(),
            }
            # The row is read before the profiled steps (and the rest of the request) run.
            table = _host_table(engine, policy, extra, 40) if extra else None
            while engine.has_unfinished():
                engine.step()
            for rid in list(engine._requests):
                engine._collect(rid)
            print(json.dumps(row), flush=True)
            if table is not None:
                print(table, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
