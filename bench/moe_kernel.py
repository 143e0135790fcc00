"""Fused MoE kernel timings on CUDA, each beside a limit measured in the same run.

    python -m freetoken_agent.bench.moe_kernel [--no-sweep]

Decode (T = 1, 4): weight bytes of the distinct rows read / time, next to the HBM bandwidth of a
large device-to-device copy (read + write counted). Two timings: eager (triton.testing.do_bench
median, L2 flushed before each call, launch overhead included) and one decode step of L layers
captured in a CUDA graph (per layer; every layer reads its own rows, so L2 cannot hold them).
Prefill (T = 4096): TFLOP/s next to torch.matmul bf16 on an 8192^3 product.
Each row names its tiles ("default" = the table in kernels/triton/moe_common.py); the sweep rows
are candidates for that table.

Shape legend: T tokens, H hidden, I expert width, N experts (bank rows per layer), K top-k.
"""

import argparse

import torch
import triton
from triton.testing import do_bench

from freetoken_agent.bench.cuda_graph import captured
from freetoken_agent.bench.limits import hbm_copy_bandwidth, matmul_rate
from freetoken_agent.help_format import DefaultsHelpFormatter
from freetoken_agent.kernels.triton.fused_moe import (
    DECODE_TILES,
    PREFILL_TILES,
    fused_moe_decode,
    fused_moe_prefill,
)

SHAPES = {  # real shapes, random weights (nothing is downloaded)
    "qwen3-30b-a3b": dict(h=2048, i=768, n=128, k=8),
    "qwen3.6-35b-a3b": dict(h=2048, i=512, n=256, k=8),
}
GRAPH_LAYERS = 8  # layers per captured decode step: 8 x 75 MB of rows, far beyond the 50 MB L2
DECODE_SWEEP = [  # each overrides a few keys of the default tiles
    dict(BLOCK_N=16, BLOCK_K=128),
    dict(BLOCK_H=128, STAGES_UP=4, BLOCK_K=256, WARPS_DOWN=8, STAGES_DOWN=3),
    dict(BLOCK_I=32, BLOCK_H=128, STAGES_UP=3, BLOCK_N=64, WARPS_DOWN=8, STAGES_DOWN=3),
    dict(STAGES_UP=3, STAGES_DOWN=3),
]
# One side at a time around the (2048, 768) entry, so each graph time's difference is that
# kernel's: gate/up's grid is P * I / BLOCK_I programs (192 at BLOCK_I=32 for 132 SMs, unevenly
# spread) and down's P * H / BLOCK_N.
WIDE_DECODE_SWEEP = [
    dict(BLOCK_I=16, BLOCK_H=128, WARPS_UP=4, STAGES_UP=4),
    dict(BLOCK_I=16, BLOCK_H=256, WARPS_UP=4, STAGES_UP=3),
    dict(BLOCK_I=16, BLOCK_H=128, WARPS_UP=2, STAGES_UP=4),
    dict(BLOCK_I=32, BLOCK_H=128, WARPS_UP=4, STAGES_UP=4),
    dict(BLOCK_I=32, BLOCK_H=256, WARPS_UP=8, STAGES_UP=3),
    dict(BLOCK_I=16, BLOCK_H=64, WARPS_UP=2, STAGES_UP=6),
    dict(BLOCK_N=32, BLOCK_K=128, WARPS_DOWN=4, STAGES_DOWN=4),
    dict(BLOCK_N=32, BLOCK_K=256, WARPS_DOWN=4, STAGES_DOWN=3),
    dict(BLOCK_N=64, BLOCK_K=256, WARPS_DOWN=8, STAGES_DOWN=3),
    dict(BLOCK_N=16, BLOCK_K=256, WARPS_DOWN=2, STAGES_DOWN=4),
    dict(BLOCK_N=32, BLOCK_K=128, WARPS_DOWN=8, STAGES_DOWN=3),
    dict(BLOCK_N=128, BLOCK_K=64, WARPS_DOWN=8, STAGES_DOWN=4),
]
PREFILL_SWEEP = [
    dict(BLOCK_M=128, BLOCK_N=64, STAGES_UP=4, WARPS_DOWN=8, STAGES_DOWN=3),
    dict(BLOCK_M=64, BLOCK_N=64, WARPS_UP=4, STAGES_UP=4, DOWN_BLOCK_N=64, STAGES_DOWN=4),
    dict(BLOCK_M=128, BLOCK_N=128, WARPS_UP=8, STAGES_UP=3, DOWN_BLOCK_N=256, WARPS_DOWN=8),
]


def make_banks(s: dict, layers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Banks of layers * N rows, bf16, std 2/sqrt(fan_in) so values are O(1)."""
    h, i, rows = s["h"], s["i"], layers * s["n"]
    w13 = torch.empty(rows, 2 * i, h, dtype=torch.bfloat16, device="cuda")
    w2 = torch.empty(rows, h, i, dtype=torch.bfloat16, device="cuda")
    return w13.normal_(0, 2 / h**0.5), w2.normal_(0, 2 / i**0.5)


def make_tokens(s: dict, t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(t, s["h"], device="cuda", generator=g).bfloat16()  # [T, H]
    scores = torch.rand(t, s["n"], device="cuda", generator=g)
    ids = scores.topk(s["k"], dim=1).indices  # [T, K] near-uniform routing: the worst case
    weights = torch.softmax(torch.randn(t, s["k"], device="cuda", generator=g), dim=1)
    return hidden, ids, weights


def row_bytes(ids: torch.Tensor, s: dict) -> int:
    """Bytes of the distinct rows a call must read: w13 and w2 of each, bf16."""
    return ids[ids >= 0].unique().numel() * 3 * s["h"] * s["i"] * 2


def graph_ms_per_layer(s, w13, w2, hidden, ids, wts, tiles) -> float:
    """One decode step of GRAPH_LAYERS layers in a CUDA graph, each on its own rows; per layer."""
    layer_ids = [(ids + layer * s["n"]).contiguous() for layer in range(GRAPH_LAYERS)]
    outs = [torch.empty_like(hidden) for _ in layer_ids]
    step = lambda: [
        fused_moe_decode(hidden, w13, w2, lid, wts, out, tiles=tiles)
        for lid, out in zip(layer_ids, outs, strict=True)
    ]
    return do_bench(captured(step), return_mode="median") / GRAPH_LAYERS


def bench_decode(s: dict, w13, w2, t: int, hbm: float, sweep: list[dict]) -> None:
    hidden, ids, wts = make_tokens(s, t, seed=t)
    out = torch.empty_like(hidden)
    nbytes = row_bytes(ids, s)
    for name, tiles in [("default", None)] + [(str(c), c) for c in sweep]:
        try:
            eager = do_bench(
                lambda tiles=tiles: fused_moe_decode(hidden, w13, w2, ids, wts, out, tiles=tiles),
                return_mode="median",
            )
            graph = graph_ms_per_layer(s, w13, w2, hidden, ids, wts, tiles)
        except Exception as e:  # a candidate may not compile (resources); report and go on
            print(f"  decode T={t:<5} {name}: failed: {type(e).__name__}: {e}"[:200])
            continue
        gbps = nbytes / graph / 1e6
        print(
            f"  decode T={t:<5} eager {eager * 1e3:7.1f} us  graph {graph * 1e3:7.1f} us/layer  "
            f"{nbytes / 1e6:6.1f} MB  {gbps:7.0f} GB/s = {100 * gbps / hbm:3.0f}% of copy  {name}"
        )


def bench_prefill(s: dict, w13, w2, t: int, mm: float, hbm: float, sweep: bool) -> None:
    hidden, ids, wts = make_tokens(s, t, seed=t)
    out = torch.empty_like(hidden)
    flops = 6 * t * s["k"] * s["h"] * s["i"]  # gate, up and down: 2 * H * I each per pair
    nbytes = row_bytes(ids, s)
    for name, tiles in [("default", None)] + [(str(c), c) for c in PREFILL_SWEEP if sweep]:
        try:
            ms = do_bench(
                lambda tiles=tiles: fused_moe_prefill(hidden, w13, w2, ids, wts, out, tiles=tiles),
                return_mode="median",
            )
        except Exception as e:
            print(f"  prefill T={t} {name}: failed: {type(e).__name__}: {e}"[:200])
            continue
        tflops = flops / ms / 1e9
        print(
            f"  prefill T={t:<4} {ms * 1e3:8.1f} us  {tflops:6.1f} TFLOP/s = "
            f"{100 * tflops / mm:3.0f}% of matmul  rows {nbytes / ms / 1e6:5.0f} GB/s = "
            f"{100 * nbytes / ms / 1e6 / hbm:3.0f}% of copy  {name}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="freetoken bench moe-kernel",
        description=__doc__.splitlines()[0],
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument("--no-sweep", action="store_true", help="time the default tiles only")
    parser.add_argument(
        "--wide", action="store_true", help="decode: one side at a time (WIDE_DECODE_SWEEP)"
    )
    parser.add_argument("--shape", choices=SHAPES, nargs="+", default=list(SHAPES),
                        help="model shapes to time")  # fmt: skip
    parser.add_argument("--skip-prefill", action="store_true", help="decode rows only")
    args = parser.parse_args(argv)
    assert torch.cuda.is_available(), "this benchmark needs a CUDA device"
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    dev = torch.device("cuda")
    hbm, mm = hbm_copy_bandwidth(dev) / 1e9, matmul_rate(dev) / 1e12
    print(f"HBM copy {hbm:.0f} GB/s (read + write)   torch.matmul bf16 8192^3 {mm:.0f} TFLOP/s")
    print(f"default tiles: decode {DECODE_TILES['default']}\n  prefill {PREFILL_TILES['default']}")
    decode_sweep = [] if args.no_sweep else WIDE_DECODE_SWEEP if args.wide else DECODE_SWEEP
    for name in args.shape:
        s = SHAPES[name]
        print(f"{name}: H={s['h']} I={s['i']} N={s['n']} K={s['k']} bf16")
        w13, w2 = make_banks(s, GRAPH_LAYERS)
        for t in (1, 4):
            bench_decode(s, w13, w2, t, hbm, decode_sweep)
        if not args.skip_prefill:
            bench_prefill(s, w13[: s["n"]], w2[: s["n"]], 4096, mm, hbm, not args.no_sweep)
        del w13, w2
        torch.cuda.empty_cache()

    return 0


if __name__ == "__main__":
    raise SystemExit(main())
