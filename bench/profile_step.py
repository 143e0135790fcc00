"""Where a step's time goes: torch.profiler over eager decode steps and one prefill chunk of a
real-shaped random model (default: the 12-layer Qwen3-30B-A3B slice).

    python -m freetoken_agent.bench.profile_step [--layers 12] [--prefill 512]

Prints the top operators by device time and by host time for each phase, and the wall time per
step with CUDA graphs on and off.
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from torch.profiler import ProfilerActivity, profile

from freetoken_agent.bench.random_model import QWEN3_30B_A3B, peer_slice, random_engine
from freetoken_agent.engine.sampling_params import SamplingParams
from freetoken_agent.help_format import DefaultsHelpFormatter


def decode_steps(engine, n: int) -> float:
    """Seconds a decode step over `n` steps (the host waits for the device at both ends)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        engine.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / n


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="freetoken bench profile",
        description=__doc__.splitlines()[0],
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument("--layers", type=int, default=12, help="model depth (12: peer slice)")
    parser.add_argument("--prefill", type=int, default=512, help="prefill chunk (tokens)")
    parser.add_argument("--rows", type=int, default=25, help="kernels listed per table")
    args = parser.parse_args(argv)
    engine = random_engine(peer_slice(QWEN3_30B_A3B, args.layers), max_num_seqs=4)
    rng = random.Random(0)
    vocab = engine.spec.vocab_size
    sp = SamplingParams(max_tokens=10_000, temperature=0, ignore_eos=True)
    engine.submit([rng.randrange(vocab) for _ in range(256)], sp)
    for _ in range(5):
        engine.step()
    graphed = decode_steps(engine, 50)
    graphs, engine.runner.graphs = engine.runner.graphs, None
    eager = decode_steps(engine, 20)
    print(f"decode step: graphs {graphed * 1e3:.2f} ms, eager {eager * 1e3:.2f} ms")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        decode_steps(engine, 5)
    table = prof.key_averages()
    print("== eager decode, by device time ==")
    print(table.table(sort_by="cuda_time_total", row_limit=args.rows))
    print("== eager decode, by host time ==")
    print(table.table(sort_by="cpu_time_total", row_limit=args.rows))
    engine.runner.graphs = graphs
    prompt = [rng.randrange(vocab) for _ in range(args.prefill)]
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    engine.generate(prompt, one)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.generate([rng.randrange(vocab) for _ in range(args.prefill)], one)
    table = prof.key_averages()
    print(f"== prefill {args.prefill}, by device time ==")
    print(table.table(sort_by="cuda_time_total", row_limit=args.rows))
    print(f"== prefill {args.prefill}, by host time ==")
    print(table.table(sort_by="cpu_time_total", row_limit=args.rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
