"""The device memory one step allocates beyond the engine's fixed memory, beside the estimate
the slot count is sized with (`placement.workspace_bytes`).

    python -m freetoken_agent.bench workspace [--layers 12] [--prompts 2048 4096 8192]
        [--budget-gb 8.59] [--out DIR]

KV pages and expert slots live in the elastic arena (driver allocations outside torch's
allocator), so torch's peak allocation during a step is the step's workspace: activations,
the MoE kernels' per-pair buffers, logits. An estimate below the peak means a budget the
engine overruns; one far above it means slots given away for nothing (at the 8 GiB laptop
tier each 9.4 MB slot is 0.07% of the experts). Measured for an all-resident engine (prefill
compute-bound, the fused MoE in PREFILL_CHUNK_PAIRS chunks) and an offloaded one (prefill
streams whole layers, in STREAMED_MOE_PAIRS chunks), with the prefill time beside each.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import replace
from pathlib import Path

import torch

from freetoken_agent.bench.environment import ENVIRONMENT
from freetoken_agent.bench.offload import offload_engine
from freetoken_agent.bench.offload_limits import timed_prefill
from freetoken_agent.bench.random_model import QWEN3_30B_A3B, peer_slice, random_engine
from freetoken_agent.engine.experts.placement import workspace_bytes
from freetoken_agent.help_format import DefaultsHelpFormatter

RESULTS = Path(__file__).resolve().parent / "results"


def _peak_of(engine, n: int, rng: random.Random) -> tuple[int, float]:
    """(peak bytes torch allocated beyond what it held before, seconds) for an n-token prefill
    (bench offload's timed_prefill: timed, a failed one refused)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    rate = timed_prefill(engine, n, rng)
    return torch.cuda.max_memory_allocated() - base, n / rate


def measure(engine, prompts: list[int], rng, offloaded: bool) -> dict:
    config = engine.loaded.config
    rows = {}
    for n in prompts:
        _peak_of(engine, n, rng)  # compiles the kernels for this shape
        peak, seconds = _peak_of(engine, n, rng)
        sized = replace(config, max_batched_tokens=n)
        estimate = workspace_bytes(engine.spec, sized, offloaded=offloaded)
        row = {"peak_gb": peak / 1e9, "estimate_gb": estimate / 1e9,
               "peak_of_estimate": peak / estimate, "prefill_s": seconds}  # fmt: skip
        rows[str(n)] = row
        print(f"{'offloaded' if offloaded else 'resident'}|{n}", json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="freetoken bench workspace",
        description=__doc__,
        epilog=ENVIRONMENT,
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument("--layers", type=int, default=12, help="model depth (12: peer slice)")
    parser.add_argument("--prompts", type=int, nargs="+", default=[2048, 4096, 8192],
                        help="prefill lengths (tokens), each one chunk")  # fmt: skip
    parser.add_argument("--budget-gb", type=float, default=8.59, help="offloaded engine budget")
    parser.add_argument("--out", type=Path, default=RESULTS, help="JSON results folder")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("this benchmark needs CUDA")
    rng = random.Random(0)
    cfg = peer_slice(QWEN3_30B_A3B, args.layers)
    chunk = max(args.prompts)
    report = {"bench": "workspace", "layers": args.layers, "prompts": args.prompts}
    engine = random_engine(cfg, kv_tokens=chunk + 64, max_num_seqs=4, max_batched_tokens=chunk,
                           max_model_len=chunk + 64)  # fmt: skip
    report["resident"] = measure(engine, args.prompts, rng, offloaded=False)
    engine.close()
    del engine
    torch.cuda.empty_cache()
    engine, _, _ = offload_engine(args.layers, args.budget_gb, chunk)
    report["offloaded"] = measure(engine, args.prompts, rng, offloaded=True)
    report["slots"] = engine.loaded.bank.cache.n_slots
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"workspace_{args.layers}l.json"
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
