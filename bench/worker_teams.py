"""The CPU worker's job time per kernel team: its OpenMP team against its own SpinTeam.

    python -m freetoken_agent.bench worker-teams [--experts 1 2 4] [--gap-us 500] [--jobs 200]
        [--threads N] [--out DIR]

A decode graph's CPU branch (kernels/cpu/worker.py) gets a job per layer that misses, a few
hundred microseconds apart. This posts such jobs to a real worker from Python, the way the
device does (data, then POST; it polls ANSWER while sleeping, so it takes no core), with the
main thread's own OpenMP team made first, as an engine's is. Per team and job size: the
worker's median busy time a job (its own clock), and the weight bytes a job reads over it,
beside the host's read bandwidth (the limit; bench/limits.py). The Qwen3-30B-A3B expert
(H 2048, I 768, K 8), bf16, from a pool larger than the last-level cache, each job's experts
continuing a sweep through it, as decode reads its rows. Runs on any CPU.

Shape legend: H hidden, W (I) expert width, K top-k, N pool rows.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from freetoken_agent.bench.environment import ENVIRONMENT
from freetoken_agent.bench.limits import host_read_bandwidth
from freetoken_agent.help_format import DefaultsHelpFormatter
from freetoken_agent.kernels.cpu import experts, worker
from freetoken_agent.kernels.cpu.worker import ANSWER, BUSY_NS, POST, TOKENS

H, W, K = 2048, 768, 8  # Qwen3-30B-A3B: hidden, expert width (I), top-k


def job_times(team: str, w13: torch.Tensor, w2: torch.Tensor, n_experts: int, jobs: int,
              gap_s: float, threads: int | None) -> tuple[list[float], int]:  # fmt: skip
    """Busy seconds of each of `jobs` one-token jobs of `n_experts` experts, and the threads
    the team ran (`threads`, else the team's own default, as the engine's worker starts it)."""
    n_rows = w13.shape[0]
    box = worker.Mailbox.allocate(1, K, H, w13.dtype, pin=False)
    cpu = worker.CpuWorker(box, w13, w2, threads=threads, team=team)
    x = torch.randn(1, H).to(w13.dtype)
    weights = torch.rand(K)
    times, at = [], 0
    try:
        for seq in range(1, jobs + 1):
            rows = torch.full((K,), -1, dtype=torch.int64)
            rows[:n_experts] = torch.arange(at, at + n_experts) % n_rows
            at += n_experts
            box.hidden[:1].copy_(x)
            box.rows.copy_(rows)
            box.weights.copy_(weights)
            box.ctrl[TOKENS] = 1
            busy0 = int(box.ctrl[BUSY_NS])
            box.ctrl[POST] = seq
            while int(box.ctrl[ANSWER]) != seq:
                time.sleep(2e-5)
            times.append((int(box.ctrl[BUSY_NS]) - busy0) / 1e9)
            time.sleep(gap_s)
    finally:
        cpu.stop()
    return times, cpu.threads


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="freetoken bench worker-teams",
        description=__doc__,
        epilog=ENVIRONMENT,
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument("--experts", type=int, nargs="+", default=[1, 2, 4],
                        help="experts a job (one token)")  # fmt: skip
    parser.add_argument("--gap-us", type=float, default=500.0,
                        help="pause between jobs (a decode layer's other work)")  # fmt: skip
    parser.add_argument("--jobs", type=int, default=200, help="jobs per team and size")
    parser.add_argument("--threads", type=int, default=None,
                        help="kernel threads of both teams (default: each team's own, as the "
                        "engine's worker starts it: FREETOKEN_CPU_THREADS, else the spin "
                        "team's spin_team_size() and the omp team's default_threads(); each "
                        "row records its count)")  # fmt: skip
    parser.add_argument("--pool-gb", type=float, default=2.0, help="expert pool size (GB)")
    parser.add_argument("--out", type=Path, default=None, help="write worker_teams.json here")
    args = parser.parse_args(argv)
    if not worker.available():
        print("no SIMD expert kernel on this machine (no C++ compiler?): nothing to measure")
        return 1
    expert_bytes = 3 * H * W * 2
    n_rows = max(16, int(args.pool_gb * 1e9 // expert_bytes))
    w13 = torch.randn(n_rows, 2 * W, H, dtype=torch.bfloat16)
    w2 = torch.randn(n_rows, H, W, dtype=torch.bfloat16)
    rows = torch.full((1, K), -1, dtype=torch.int64)
    rows[0, 0] = 0
    x = torch.randn(1, H).to(torch.bfloat16)
    experts.cpu_experts(x, w13, w2, rows, torch.rand(1, K), threads=args.threads)  # main's team
    limit = host_read_bandwidth()
    report = {"bench": "worker-teams", "host_read_gb_s": limit / 1e9, "gap_us": args.gap_us,
              "threads": args.threads, "rows": []}  # fmt: skip
    for n in args.experts:
        for team in worker.TEAMS:
            times, threads = job_times(team, w13, w2, n, args.jobs, args.gap_us / 1e6,
                                       args.threads)  # fmt: skip
            times.sort()
            median = times[len(times) // 2]
            row = {"team": team, "threads": threads, "experts": n, "median_ms": 1e3 * median,
                   "gb_s": n * expert_bytes / median / 1e9,
                   "of_read_limit": n * expert_bytes / median / limit}  # fmt: skip
            report["rows"].append(row)
            print(json.dumps(row), flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "worker_teams.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
