"""Where an offloaded decode step's device time goes, kernel by kernel, in the graphs the engine
replays (not eager steps: `bench profile` times those, all-resident).

    python -m freetoken_agent.bench step-kernels [--layers 12] [--budget-gb 8.59]
        [--policies gpu-fill transfer] [--adaptive-path device] [--regime native] [--batch 1]
        [--steps 16]

Why: at 48 layers and 32 GB, native routing decodes at ~4.0 ms a token on the device path
against a ~1.5 ms limit (bench/results/NOTES.md, twentieth session): the step's own kernels,
not its misses, bound it. Per policy row (from an empty cache, after `--warm` steps): the wall
time a step unprofiled, then torch.profiler (CUPTI records the kernels of graph replays) over
`--steps` steps: the device time a step, every kernel's device time and launches a step, and
the same divided by the MoE layers; and who handed the cache back to the host during the
unprofiled steps (DeviceFills.release: a sync and a rebuild of the host's mirror; the 48-layer
table of the twentieth session showed 0.25 a step at b=4 under gpu-fill and adaptive), by
caller. JSON lines; `--out` also writes them to a file.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from freetoken_agent.bench.environment import ENVIRONMENT
from freetoken_agent.bench.offload import offload_engine
from freetoken_agent.bench.offload_decode import start_policy
from freetoken_agent.bench.offload_summaries import cpu_share_stats
from freetoken_agent.bench.profile_step import decode_steps
from freetoken_agent.bench.routing_traces import Regime, TracedRouting, TraceGenerator
from freetoken_agent.engine.experts.device_fills import DeviceFills
from freetoken_agent.engine.experts.step_paths import CPU_PATHS, DEVICE_PATHS
from freetoken_agent.engine.sampling_params import SamplingParams
from freetoken_agent.help_format import DefaultsHelpFormatter

_CACHE_FILES = ("device_fills.py", "cache.py")


@contextlib.contextmanager
def release_callers() -> Iterator[Counter]:
    """Counts DeviceFills.release calls that hand an owned cache back while the block runs,
    by the first caller outside the cache's own files ("file.py:function")."""
    callers: Counter = Counter()
    release = DeviceFills.release

    def counted(self) -> None:
        if self.owned:
            frame = sys._getframe(1)
            while frame is not None and os.path.basename(frame.f_code.co_filename) in _CACHE_FILES:
                frame = frame.f_back
            where = "?" if frame is None else frame.f_code.co_filename
            name = "?" if frame is None else frame.f_code.co_name
            callers[f"{os.path.basename(where)}:{name}"] += 1
        release(self)

    DeviceFills.release = counted
    try:
        yield callers
    finally:
        DeviceFills.release = release


def kernel_rows(events, steps: int, layers: int) -> tuple[float, list[dict]]:
    """(device us a step, rows by device time): `events` torch.profiler's key averages."""
    rows = [e for e in events if e.device_type.name == "CUDA" and e.self_device_time_total > 0]
    rows.sort(key=lambda e: e.self_device_time_total, reverse=True)
    total = sum(e.self_device_time_total for e in rows) / steps
    return total, [
        {
            "kernel": e.key[:120],
            "us_per_step": round(e.self_device_time_total / steps, 2),
            "launches_per_step": round(e.count / steps, 2),
            "us_per_layer": round(e.self_device_time_total / steps / layers, 3),
        }
        for e in rows
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="freetoken bench step-kernels",
        description=__doc__,
        epilog=ENVIRONMENT,
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument("--layers", type=int, default=12, help="model depth (12: peer slice)")
    parser.add_argument("--budget-gb", type=float, default=8.59, help="GPU budget (GB)")
    parser.add_argument(
        "--policies",
        nargs="+",
        default=["gpu-fill", "transfer"],
        help="offload policies, one row each (adaptive: the path --adaptive-path held)",
    )
    parser.add_argument(
        "--adaptive-path", default="device", choices=DEVICE_PATHS,
        help="the whole-step path adaptive's rows hold (shared: the CPU worker's wait is inside "
        "the copy kernel's time, and the row reports the worker's jobs)",
    )  # fmt: skip
    parser.add_argument(
        "--regime", default="native", help="routing: native, uniform or zipf:S,loc:P"
    )
    parser.add_argument("--batch", type=int, default=1, help="sequences decoding together")
    parser.add_argument("--warm", type=int, default=32, help="decode steps before timing")
    parser.add_argument("--steps", type=int, default=16, help="decode steps profiled")
    parser.add_argument("--rows", type=int, default=30, help="kernels printed per row")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON lines here")
    args = parser.parse_args(argv)
    from torch.profiler import ProfilerActivity, profile

    engine, b_p, b_h = offload_engine(args.layers, args.budget_gb, 8192)
    bank, model, spec = engine.loaded.bank, engine.loaded.model, engine.spec
    if args.regime != "native":
        gen = TraceGenerator(spec.n_moe_layers, spec.n_experts, spec.top_k,
                             Regime.parse(args.regime), seed=0)  # fmt: skip
        model.set_expert_bank(TracedRouting(bank, gen))
    engine.capture_graphs()
    rng = random.Random(0)
    lines = []
    for policy in args.policies:
        path = args.adaptive_path if policy == "adaptive" else None
        # (a held CPU path runs ungated: its gate waits for fill races only the stops path makes)
        start_policy(engine, bank, policy, b_p, b_h, path=path, shared_gate=path not in CPU_PATHS)
        n = args.warm + 2 * args.steps + 8
        sp = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        for _ in range(args.batch):
            engine.submit([rng.randrange(spec.vocab_size) for _ in range(64)], sp)
        reserve = getattr(model.expert_bank, "reserve", None)
        if reserve is not None:  # the traces' draws before the clock starts
            reserve(n * args.batch)
        decode_steps(engine, args.warm)
        with release_callers() as callers:
            wall = decode_steps(engine, args.steps)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            profiled = decode_steps(engine, args.steps)
        device_us, rows = kernel_rows(prof.key_averages(), args.steps, spec.n_moe_layers)
        while engine.has_unfinished():
            engine.step()
        for rid in list(engine._requests):
            engine._collect(rid)
        line = {
            "policy": policy, "layers": spec.n_layers, "budget_gb": args.budget_gb,
            "regime": args.regime, "batch": args.batch, "slots": bank.cache.n_slots,
            "wall_ms_per_step": round(1e3 * wall, 3),
            "profiled_wall_ms_per_step": round(1e3 * profiled, 3),
            "device_ms_per_step": round(device_us / 1e3, 3),
            "launches_per_step": round(sum(r["launches_per_step"] for r in rows), 1),
            "releases_per_step": round(sum(callers.values()) / args.steps, 3),
            "release_callers": dict(callers.most_common()),
            "path": path,
            "worker": cpu_share_stats(bank) if path in CPU_PATHS else None,
            "kernels": rows,
        }  # fmt: skip
        lines.append(line)
        print(json.dumps({k: v for k, v in line.items() if k != "kernels"}), flush=True)
        for r in rows[: args.rows]:
            print(f"{r['us_per_step']:10.1f} {r['launches_per_step']:7.1f} "
                  f"{r['us_per_layer']:8.2f}  {r['kernel'][:100]}", flush=True)  # fmt: skip
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
