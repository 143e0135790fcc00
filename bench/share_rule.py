"""The shared path's CPU share replayed on routing traces with a per-layer time model: which
rule for a layer's misses shortens decode steps, before a device run (any CPU, no model).

    python -m freetoken_agent.bench share-rule [--layers 48] [--slots 3019] [--batch 4]

Rules (the cache is one LRU over (layer, expert) slots, as the device path's plan keeps it):
- fill-all: every miss filled (policy gpu-fill's device path);
- by-order: the CPU takes round(m x share) of a layer's m misses spread by order, a lone miss
  included (the shared path's rule before the thirty-sixth session);
- rule: kernels/reference_fills.py `cpu_misses` itself, with the popularity counts: never
  all of a layer's misses (a lone miss fills), and the least used.
A miss the CPU takes is not cached. A layer's cost beyond the native step is the slower of
its two branches: fills x --fill-us on the link, and the CPU's experts x --cpu-us plus
--handshake-us when it has any. The defaults are H200 figures (a fill at the copy kernel's
~51 GB/s; a CPU expert at ~70 GB/s alone, ~50 beside the link: try 190; the native 48-layer
step 3.52 ms at b=1, 6.94 at b=4). Popularity pins are not modelled. The thirty-sixth
session's replay (48 layers, 3,019 slots, Zipf 1.0 / loc 0.7; tok/s at --cpu-us 135 / 190)
against the H200 (bench/results/NOTES.md):

    rule       b=1 modelled (measured)        b=4 modelled (measured)
    fill-all   120.1 (gpu-fill 122.8-130.7)   153.8 (175.2-179.1)
    by-order   93.8 / 77.7 (77.8)             209.4 / 177.0 (not run)
    rule       131.1 / 123.0 (124.4)          221.8 / 195.0 (188.9-227.9)
"""

from __future__ import annotations

import argparse
import json
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from freetoken_agent.bench.cache_policies import add_trace_options, trace_lids
from freetoken_agent.bench.routing_traces import Regime
from freetoken_agent.help_format import DefaultsHelpFormatter
from freetoken_agent.kernels.reference_fills import SHARE_ONE, cpu_count, cpu_misses

RULES = ("fill-all", "by-order", "rule")
HALF_LIFE = 512  # steps between halvings of the use counts (popular_pins.py's)


FILL_US, CPU_US, HANDSHAKE_US, BASE_MS = 185.0, 135.0, 20.0, 3.52  # the H200's (docstring)


@dataclass(slots=True, frozen=True)
class Costs:
    fill_us: float = FILL_US
    cpu_us: float = CPU_US
    handshake_us: float = HANDSHAKE_US
    base_ms: float = BASE_MS

    def layer_us(self, fills: int, on_cpu: int) -> float:
        cpu = self.handshake_us + on_cpu * self.cpu_us if on_cpu else 0.0
        return max(fills * self.fill_us, cpu)


def layer_cpu(rule: str, misses: list[int], share: int, uses: torch.Tensor) -> list[int]:
    """The misses (lids in order of first appearance) the CPU takes under `rule`."""
    if rule == "fill-all":
        return []
    if rule == "by-order":
        return [lid for r, lid in enumerate(misses)
                if cpu_count(r + 1, share) > cpu_count(r, share)]  # fmt: skip
    return cpu_misses(misses, share, uses)


def replay(rule: str, routes: np.ndarray, slots: int, share: float, costs: Costs,
           warm: int) -> dict:  # fmt: skip
    """routes [steps, layers, B * K] lids; the steps from `warm` on are counted."""
    steps, layers, _ = routes.shape
    cache: OrderedDict[int, None] = OrderedDict()
    uses = torch.zeros(int(routes.max()) + 1, dtype=torch.int32)
    fixed = round(share * SHARE_ONE)
    fills = on_cpu = experts = 0
    extra_us = 0.0
    for s in range(steps):
        counted = s >= warm
        if s and s % HALF_LIFE == 0:
            uses >>= 1
        for layer in range(layers):
            used = list(dict.fromkeys(routes[s, layer].tolist()))
            uses[used] += 1
            misses = [lid for lid in used if lid not in cache]
            for lid in used:
                if lid in cache:
                    cache.move_to_end(lid)
            cpu = set(layer_cpu(rule, misses, fixed, uses))
            filled = [lid for lid in misses if lid not in cpu]
            for lid in filled:
                if len(cache) >= slots:
                    cache.popitem(last=False)
                cache[lid] = None
            if counted:
                fills, on_cpu, experts = fills + len(filled), on_cpu + len(cpu), experts + len(used)
                extra_us += costs.layer_us(len(filled), len(cpu))
    n = steps - warm
    step_ms = costs.base_ms + extra_us / 1e3 / n
    return {"fills_per_step": fills / n, "cpu_per_step": on_cpu / n,
            "miss_rate": (fills + on_cpu) / experts, "step_ms": step_ms}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="freetoken bench share-rule",
        description=__doc__,
        formatter_class=DefaultsHelpFormatter,
    )
    add_trace_options(parser, slots=3019)
    parser.add_argument("--batch", type=int, default=4, help="tokens a decode step")
    parser.add_argument("--steps", type=int, default=1500, help="decode steps replayed")
    parser.add_argument("--warm", type=int, default=300, help="steps before costs count")
    parser.add_argument(
        "--share",
        type=float,
        default=0.6,
        help="the CPU's share of a layer's misses (q*'s is B_H / (B_P + B_H))",
    )
    parser.add_argument("--fill-us", type=float, default=FILL_US,
                        help="one fill over the link, us")  # fmt: skip
    parser.add_argument("--cpu-us", type=float, default=CPU_US,
                        help="one expert on the CPU worker, us")  # fmt: skip
    parser.add_argument("--handshake-us", type=float, default=HANDSHAKE_US,
                        help="a layer's post to the worker and its answer, us")  # fmt: skip
    parser.add_argument(
        "--base-ms",
        type=float,
        default=None,
        help="the step with no miss, ms (default 3.52 at b=1, 6.94 above)",
    )
    args = parser.parse_args(argv)
    if args.batch < 1 or args.warm >= args.steps or not 0 <= args.share <= 1:
        parser.error("need --batch >= 1, --warm < --steps and --share in [0, 1]")
    base = args.base_ms if args.base_ms is not None else (BASE_MS if args.batch == 1 else 6.94)
    costs = Costs(args.fill_us, args.cpu_us, args.handshake_us, base)
    regime = Regime.parse(args.regime)
    k, n_tokens = args.top_k, args.steps * args.batch
    lids, _ = trace_lids(regime, args.layers, args.experts, k, n_tokens, args.seed)
    # [tokens, layers, K] -> a step's B tokens of each layer together: [steps, layers, B * K]
    routes = np.asarray(lids).reshape(args.steps, args.batch, args.layers, k)
    routes = routes.transpose(0, 2, 1, 3).reshape(args.steps, args.layers, args.batch * k)
    rows = {rule: replay(rule, routes, args.slots, args.share, costs, args.warm) for rule in RULES}
    for rule, row in rows.items():
        print(f"{rule:9s} fills {row['fills_per_step']:7.2f}  cpu {row['cpu_per_step']:7.2f}  "
              f"miss rate {row['miss_rate']:.4f}  step {row['step_ms']:6.2f} ms  "
              f"{args.batch * 1e3 / row['step_ms']:7.1f} tok/s (modelled)")  # fmt: skip
    report = {"bench": "share-rule", **{k: v for k, v in vars(args).items() if k != "out"},
              "base_ms": base, "rows": rows}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"share_rule_{args.layers}l_b{args.batch}.json"
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
