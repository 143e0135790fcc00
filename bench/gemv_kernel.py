"""Decode projections: torch's F.linear against the Triton skinny matmul (kernels/triton/gemv.py),
each beside the HBM limit measured in the same run.

    python -m freetoken_agent.bench gemv [--no-sweep] [--out DIR]

Shapes are the Qwen3-30B-A3B decode projections (bf16, random weights): qkv 2048 -> 5120,
o 4096 -> 2048, router 2048 -> 128, lm_head 2048 -> 151936; M = 1 and 4 rows. The router also
runs as it routes: F.linear then softmax_topk (`torch+topk`) against the one-launch `route`
(kernels/triton/route.py) and its tile candidates (ROUTE_SWEEP). Each is timed as
GRAPH_LAYERS different weights of that shape in one CUDA graph (per call; the weights together
exceed the 50 MB L2 except the router's, which a decode step reads once a layer as here), and
reported as weight bytes / time beside the HBM bandwidth of a large copy (read + write counted).
The sweep times tile candidates for `choose_tiles` (SWEEP; SPLIT_SWEEP with the K split
given, at the qkv and o shapes), and at the o shape the decode step's o_proj + residual add +
norm: F.linear then the norm kernel against the one launch (kernels/triton/proj_norm.py) and
its candidates. JSON: `gemv_kernel.json`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from freetoken_agent.bench.cuda_graph import captured
from freetoken_agent.bench.limits import hbm_copy_bandwidth
from freetoken_agent.help_format import DefaultsHelpFormatter
from freetoken_agent.kernels.router import softmax_topk
from freetoken_agent.kernels.triton.gemv import choose_tiles, gemv
from freetoken_agent.kernels.triton.route import route

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = {"qkv": (5120, 2048), "o": (2048, 4096), "router": (128, 2048), "lm_head": (151936, 2048)}
GRAPH_LAYERS = 8
SWEEP = [
    dict(BLOCK_N=16, BLOCK_K=256),
    dict(BLOCK_N=64, BLOCK_K=128),
    dict(BLOCK_N=32, BLOCK_K=512, WARPS=8),
    dict(BLOCK_N=32, BLOCK_K=128, WARPS=2),
]

# K split explicitly (the SWEEP above keeps choose_tiles' split): the skinny matmul and the
# o_proj + add + norm launch (kernels/triton/proj_norm.py) at the qkv and o shapes. The
# default streams 16 KB a program a step; these trade programs, warps and bytes in flight.
SPLIT_SWEEP = [
    dict(BLOCK_N=16, BLOCK_K=256, WARPS=2),
    dict(BLOCK_N=32, BLOCK_K=256, WARPS=4, SPLIT_K=8),
    dict(BLOCK_N=32, BLOCK_K=256, WARPS=4, SPLIT_K=16),
    dict(BLOCK_N=16, BLOCK_K=512, WARPS=4, SPLIT_K=8),
    dict(BLOCK_N=64, BLOCK_K=256, WARPS=8, SPLIT_K=8),
    dict(BLOCK_N=32, BLOCK_K=512, WARPS=4, SPLIT_K=8),
    dict(BLOCK_N=8, BLOCK_K=512, WARPS=2, SPLIT_K=4),
    dict(BLOCK_N=32, BLOCK_K=128, WARPS=2, SPLIT_K=8),
    dict(BLOCK_N=32, BLOCK_K=1024, WARPS=8, SPLIT_K=4),
    dict(BLOCK_N=16, BLOCK_K=1024, WARPS=4, SPLIT_K=2),
]
SPLIT_SHAPES = ("qkv", "o")

ROUTE_SWEEP = [  # beside route.TILES (one expert's row a program)
    dict(BLOCK_E=4, BLOCK_H=512, WARPS=1),
    dict(BLOCK_E=8, BLOCK_H=256, WARPS=4),
    dict(BLOCK_E=2, BLOCK_H=1024, WARPS=1),  # the default until the twenty-fourth session
    dict(BLOCK_E=1, BLOCK_H=1024, WARPS=1),
    dict(BLOCK_E=1, BLOCK_H=2048, WARPS=2),
]


def _routers(sweep: bool) -> dict:
    """The router's two ways, Qwen3's top-8 with rounded weights: name -> fn(x, w)."""
    out = {
        "torch+topk": lambda x, w: softmax_topk(F.linear(x, w), 8, True, torch.bfloat16),
        "route": lambda x, w: route(x, w, 8, True, torch.bfloat16),
    }
    for i, tiles in enumerate(ROUTE_SWEEP if sweep else []):
        out[f"route{i}"] = lambda x, w, t=tiles: route(x, w, 8, True, torch.bfloat16, t)
    return out


def _proj_norms(sweep: bool) -> dict:
    """o_proj + residual add + norm, as a one-row decode step runs it: F.linear then the norm
    kernel (`torch+norm`) against the one launch (`proj_norm`) and its tile candidates; label
    -> (fn(x, w, residual, norm_weight), tiles as in `_candidates`)."""
    from freetoken_agent.kernels.norm import rms_norm
    from freetoken_agent.kernels.triton.proj_norm import new_scratch, proj_add_norm

    def fused(tiles):
        scratch: dict = {}  # per weight shape and tiles, made before the capture (warm-up)

        def call(x, w, r, nw):
            key = (tuple(w.shape), x.device)
            if key not in scratch:
                scratch[key] = new_scratch(w.shape[0], w.shape[1], x.device, tiles)
            return proj_add_norm(x, w, r, nw, 1e-6, scratch=scratch[key], tiles=tiles)

        return call

    out = {"torch+norm": (lambda x, w, r, nw: rms_norm(F.linear(x, w), nw, 1e-6, r), None),
           "proj_norm": (fused(None), {})}  # fmt: skip
    for i, tiles in enumerate(SPLIT_SWEEP if sweep else []):
        out[f"proj_norm{i}"] = (fused(tiles), tiles)
    return out


def _candidates(name: str, m: int, n: int, sweep: bool) -> dict:
    """label -> (fn(x, w), tiles: the overrides it runs with, {} for the defaults, None where
    tiles do not apply) for one shape and row count."""
    out: dict = {"torch": (lambda x, w: F.linear(x, w), None), "triton": (gemv, {})}
    for i, tiles in enumerate(SWEEP if sweep else []):
        out[f"sweep{i}"] = (lambda x, w, t=tiles: gemv(x, w, tiles=t), tiles)
    for i, tiles in enumerate(SPLIT_SWEEP if sweep and name in SPLIT_SHAPES else []):
        out[f"split{i}"] = (lambda x, w, t=tiles: gemv(x, w, tiles=t), tiles)
    if name == "router":
        for label, fn in _routers(sweep).items():
            route_tiles = ROUTE_SWEEP[int(label[5:])] if label[5:].isdigit() else None
            out[label] = (fn, route_tiles)
    if name == "o":  # the decode step's o_proj + add + norm
        residual = torch.randn(m, n, device="cuda").to(torch.bfloat16)
        norm_w = (1 + 0.1 * torch.randn(n, device="cuda")).to(torch.bfloat16)
        for label, (fn, tiles) in _proj_norms(sweep).items():
            out[label] = (lambda x, w, f=fn: f(x, w, residual, norm_w), tiles)
    return out


def per_call_us(fn, weights: list[torch.Tensor], x: torch.Tensor) -> float:
    """One CUDA graph calling `fn(x, w)` for every weight; microseconds per call."""
    step = lambda: [fn(x, w) for w in weights]  # noqa: E731
    return 1e3 * do_bench(captured(step), return_mode="median") / len(weights)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="freetoken bench gemv",
        description=__doc__,
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument("--no-sweep", action="store_true", help="time the default tiles only")
    parser.add_argument("--out", type=Path, default=RESULTS, help="JSON results folder")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("this benchmark needs CUDA")
    hbm = hbm_copy_bandwidth(torch.device("cuda"))
    report: dict = {"bench": "gemv", "hbm_copy_gb_s": hbm / 1e9, "rows": {}}
    print(f"HBM copy {hbm / 1e9:.0f} GB/s")
    for name, (n, k) in SHAPES.items():
        layers = 2 if name == "lm_head" else GRAPH_LAYERS  # 622 MB each
        weights = [
            (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16) for _ in range(layers)
        ]
        nbytes = n * k * 2
        for m in (1, 4):
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            for label, (fn, tiles) in _candidates(name, m, n, not args.no_sweep).items():
                us = per_call_us(fn, weights, x)
                gb_s = nbytes / us / 1e3
                row = {"us": us, "gb_s": gb_s, "of_hbm": gb_s / (hbm / 1e9)}
                if tiles is not None:
                    row["tiles"] = tiles if label.startswith("route") else choose_tiles(n, k, tiles)
                key = f"{name}|m{m}|{label}"
                report["rows"][key] = row
                print(key, json.dumps(row), flush=True)
        del weights
        torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "gemv_kernel.json"
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
