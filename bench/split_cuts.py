"""`freetoken bench split-cuts`: adaptive's split path held at fixed cuts, at the cut its trials
find, and at other worker team sizes, against gpu-fill, in one load of the offload bench's
model (CUDA).

Why: the split path's cut (engine/experts/split_expert.py) comes from two rates that leave out
the step's other costs, and its worker's team shares the host's cores with the copier thread
and the engine's driver; this sweep is how the twenty-ninth session found the copy kernel's
2-byte loads (split ran at 84 tok/s where gpu-fill ran 121) and the best cut well below the
rates' (bench/results/NOTES.md). Each row: tok/s from an empty cache after the offload
bench's warm-up, beside its limit (host_caps.py, the offload bench's caps), the cut it ran,
the worker's jobs and their mean time.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path

from freetoken_agent.bench import offload
from freetoken_agent.bench.decode_baseline import kv_bytes_per_token
from freetoken_agent.bench.environment import ENVIRONMENT
from freetoken_agent.bench.host_caps import HostCaps
from freetoken_agent.bench.limits import hbm_copy_bandwidth, host_read_bandwidth
from freetoken_agent.bench.offload_decode import measure_policy, use_policy
from freetoken_agent.bench.offload_limits import add_limits
from freetoken_agent.bench.routing_traces import Regime, TracedRouting, TraceGenerator
from freetoken_agent.engine.experts import split_expert
from freetoken_agent.help_format import DefaultsHelpFormatter
from freetoken_agent.kernels.cpu import experts, worker


def _restart_worker(engine, bank, threads: int) -> None:
    """A new CPU worker (and split path) with a team of `threads`, the graphs captured anew
    (they hold the mailbox's addresses)."""
    path = bank.device_path
    for part in (path.split, path.cpu_share):
        if part is not None:
            part.close()
    path.split, path.cpu_share = None, None
    os.environ[experts.ENV_THREADS] = str(threads)
    path.start_share()
    engine.capture_graphs()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="freetoken bench split-cuts",
        description=__doc__,
        epilog=ENVIRONMENT,
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument("--layers", type=int, default=48, help="model depth (12: peer slice)")
    parser.add_argument("--budget-gb", type=float, default=32.0, help="GPU budget (GB)")
    parser.add_argument(
        "--regime",
        default="zipf:1.0,loc:0.7",
        help="routing: native, uniform or zipf:S,loc:P (routing_traces.py)",
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1], help="decode batch sizes")
    parser.add_argument(
        "--cuts",
        type=int,
        nargs="+",
        default=[0, 576, 384, 192, 96],
        help="cuts (columns of I) to hold; 0: the cut trials' (cut_trials.py)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        nargs="+",
        default=[],
        help="worker team sizes to run the trials' cut at, after the cuts",
    )
    parser.add_argument("--decode", type=int, default=128, help="timed tokens a row")
    parser.add_argument("--context", type=int, default=64, help="prompt tokens a sequence")
    parser.add_argument("--out", type=Path, default=offload.RESULTS, help="JSON results folder")
    args = parser.parse_args(argv)
    import torch

    width = offload.QWEN3_30B_A3B["moe_intermediate_size"]
    bad = [c for c in args.cuts if not 0 <= c < width]
    if bad:
        parser.error(f"--cuts {bad}: a cut is a column of I = {width} in [1, {width}), or 0")

    dev = torch.device("cuda")
    b_hbm, b_read = hbm_copy_bandwidth(dev), host_read_bandwidth()
    engine, b_p, b_h = offload.offload_engine(args.layers, args.budget_gb, 8192)
    bank = engine.loaded.bank
    bank.split_expert = True  # before adaptive starts its worker
    caps = HostCaps()
    caps.observe("before the engine", b_p, b_h, b_read)
    caps.probe("start", bank.pool.w13, bank.pool.w2, dev)
    spec = engine.spec
    if args.regime != "native":
        gen = TraceGenerator(spec.n_moe_layers, spec.n_experts, spec.top_k,
                             Regime.parse(args.regime), seed=0)  # fmt: skip
        engine.loaded.model.set_expert_bank(TracedRouting(bank, gen))
    # adaptive's worker from the start, so every split row counts its own jobs (they include
    # the row's warm-up steps)
    use_policy(engine, bank, "adaptive", recapture=True)
    dense = engine.loaded.dense_bytes - engine.loaded.model.embed_tokens.device_nbytes
    kv_per_token = kv_bytes_per_token(engine)
    rng = random.Random(0)
    report = {"bench": "split-cuts", "device": torch.cuda.get_device_name(dev),
              "layers": spec.n_layers, "budget_gb": args.budget_gb, "regime": args.regime,
              "rows": {}}  # fmt: skip
    cut_at = split_expert.SplitExpert._cut_at

    def measure(key: str, policy: str, batch: int, cut: int | None = None) -> None:
        # A held cut replaces the rates' and the trials' (the class's, for this row only).
        split_expert.SplitExpert._cut_at = cut_at if not cut else (lambda self, link: cut)
        share = bank.device_path.cpu_share
        before = share.box.ctrl.clone() if share is not None else None
        path = "split" if policy == "adaptive" else None
        try:
            row = measure_policy(engine, bank, policy, batch, args.decode, rng, b_p, b_h,
                                 path, True, args.context)  # fmt: skip
        finally:
            split_expert.SplitExpert._cut_at = cut_at
        share = bank.device_path.cpu_share
        if share is not None and before is not None:
            ctrl = share.box.ctrl
            jobs = int(ctrl[worker.JOBS] - before[worker.JOBS])
            busy = int(ctrl[worker.BUSY_NS] - before[worker.BUSY_NS])
            row.update(jobs=jobs, mean_job_us=busy / max(jobs, 1) / 1e3,
                       worker_threads=share.worker.threads)  # fmt: skip
        kv_read = batch * (args.context + args.decode / 2) * kv_per_token
        add_limits(row, policy, batch, bank.pool.expert_bytes, dense + kv_read, caps,
                   b_hbm)  # fmt: skip
        report["rows"][key] = row
        cut, job_us = row.get("split_cut"), row.get("mean_job_us", 0)
        print(f"{key} | {row['tok_s']:.1f} | {row['limit_tok_s']:.1f} | cut {cut} | job us "
              f"{job_us:.0f}", flush=True)  # fmt: skip
        args.out.mkdir(parents=True, exist_ok=True)
        name = f"split_cuts_{spec.n_layers}l_{int(args.budget_gb)}gb.json"
        (args.out / name).write_text(json.dumps(report, indent=1))

    print("key | tok/s | limit | cut | mean job", flush=True)
    for batch in args.batches:
        measure(f"b{batch}|gpu-fill", "gpu-fill", batch)
        for cut in args.cuts:
            measure(f"b{batch}|split|cut {cut or 'trials'}", "adaptive", batch, cut)
    for threads in args.threads:
        _restart_worker(engine, bank, threads)
        for batch in args.batches:
            measure(f"b{batch}|split|trials|{threads} threads", "adaptive", batch)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
