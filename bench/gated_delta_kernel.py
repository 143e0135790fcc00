"""Gated delta rule kernel timings (Triton), each beside its physical bound.

    python -m freetoken_agent.bench.gated_delta_kernel [--no-sweep] [--cpu] [--out PATH]

Shape of the Qwen3-Next / Qwen3.5-MoE linear-attention layers: Hk 16, Hv 32, Dk = Dv = 128, bf16
inputs and outputs, fp32 state. Prefill: one sequence of 4096 and 8192 tokens, eager
(triton.testing.do_bench median; launch overhead is noise at these lengths), in the chunked form
(the default for prefill) and the recurrent one (the fallback). Decode: batch 1 and
4, one step of GRAPH_LAYERS layers captured in a CUDA graph, reported per layer; every layer has
its own state pool, so the states (2 MiB per sequence and layer) come from HBM, not L2.

Bounds: bytes that must move (q, k, v, g, beta read, the output written, the state read and
written once) / 4.0e12 B/s of HBM, and FLOPs (7 Dk Dv per token and value head: decay, k^T S,
the rank-1 update, q^T S) / 400e12 FLOP/s, a dense bf16 tensor-core rate. The chunked form does
more FLOPs than that count (the intra-chunk matmuls, tf32x3 = three tf32 passes) on tensor
cores; the recurrent one runs on the CUDA cores, a chain of dependent steps per token.
Rows name their tiles ("default" = the table in kernels/triton/gated_delta.py); the sweep rows
are candidates for that table. `--cpu` runs small shapes through Triton's interpreter: a smoke
test of this script, its timings mean nothing (no JSON unless --out is given).

Shape legend: T tokens, B sequences, Hk / Hv key / value heads, Dk / Dv head dims.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from freetoken_agent.bench.cuda_graph import captured

RESULTS = Path(__file__).resolve().parent / "results"
HBM_BYTES_PER_S = 4.0e12
FLOPS_PER_S = 400e12
GRAPH_LAYERS = 32  # decode: 32 layers x 2 MiB of state per sequence, beyond the 50 MB L2
SHAPES = {
    "cuda": dict(hk=16, hv=32, dk=128, dv=128, prefill=(4096, 8192), decode=(1, 4)),
    "cpu": dict(hk=2, hv=4, dk=16, dv=16, prefill=(64, 128), decode=(1, 4)),
}
SWEEP = {  # per form, each overrides keys of the default tiles
    "recurrent": [
        dict(BV=8, num_warps=1),
        dict(BV=8, num_warps=2),
        dict(BV=16, num_warps=2),
        dict(BV=32, num_warps=4),
        dict(BV=32, num_warps=8),
        dict(BV=64, num_warps=8),
    ],
    "chunk": [
        dict(BV=16),
        dict(BV=16, num_stages=2),
        dict(BV=32, num_stages=2),
        dict(BV=64, num_warps=8),
        dict(num_warps=8, solve_warps=8),
        dict(precision="ieee"),
        dict(precision="tf32"),  # fast but ~1e-3 relative: informative only
    ],
}


def make_inputs(s: dict, lens: list[int], device: str, layers: int = 1) -> dict:
    """Random inputs for one call plus `layers` state pools of B + 1 rows (row 0 scratch)."""
    T, B = sum(lens), len(lens)
    bf16 = dict(device=device, dtype=torch.bfloat16)
    cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)
    return dict(
        q=torch.randn(T, s["hk"], s["dk"], **bf16),
        k=torch.randn(T, s["hk"], s["dk"], **bf16),
        v=torch.randn(T, s["hv"], s["dv"], **bf16),
        g=-torch.rand(T, s["hv"], device=device),
        beta=torch.rand(T, s["hv"], device=device),
        states=[
            torch.randn(B + 1, s["hv"], s["dk"], s["dv"], device=device) for _ in range(layers)
        ],
        slots=torch.arange(1, B + 1, device=device),
        cu=cu,
        bounds=tuple(cu.tolist()),
    )


def bound(s: dict, T: int, B: int) -> dict:
    """The physical lower bound of one call: bytes / HBM rate and FLOPs / matmul rate."""
    nbytes = (
        2 * T * s["hk"] * s["dk"] * 2  # q, k bf16
        + 2 * T * s["hv"] * s["dv"] * 2  # v read, out written, bf16
        + 2 * T * s["hv"] * 4  # g, beta fp32
        + 2 * B * s["hv"] * s["dk"] * s["dv"] * 4  # state read and written, fp32
    )
    flops = 7 * T * s["hv"] * s["dk"] * s["dv"]
    hbm_ms, flop_ms = nbytes / HBM_BYTES_PER_S * 1e3, flops / FLOPS_PER_S * 1e3
    return dict(bytes=nbytes, flops=flops, bound_ms_hbm=hbm_ms, bound_ms_flops=flop_ms,
                bound_ms=max(hbm_ms, flop_ms))  # fmt: skip


def timer(cuda: bool):
    if cuda:
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, return_mode="median")

    def cpu_median(fn) -> float:
        fn()  # the interpreter's first call pays its set-up
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    return cpu_median


def call(x: dict, state: torch.Tensor, form: str, tiles: dict | None):
    from freetoken_agent.kernels.triton.gated_delta import gated_delta_rule

    bounds = None if form == "decode" else x["bounds"]
    return gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], state, x["slots"],
                            x["cu"], x["q"].shape[-1] ** -0.5, bounds, tiles=tiles,
                            form="recurrent" if form == "decode" else form)  # fmt: skip


def decode_step(x: dict, tiles: dict | None, cuda: bool):
    """One decode step over every layer's pool; on CUDA a captured graph's replay."""
    step = lambda: [call(x, state, "decode", tiles) for state in x["states"]]  # noqa: E731
    if not cuda:
        return step
    return captured(step)


def run_case(s: dict, form: str, lens: list[int], cuda: bool, sweep: bool) -> list[dict]:
    """form: "decode" (recurrent kernel, graph), or the prefill form "recurrent" / "chunk"."""
    device = "cuda" if cuda else "cpu"
    decode = form == "decode"
    layers = GRAPH_LAYERS if decode and cuda else 1
    x = make_inputs(s, lens, device, layers)
    T, B = sum(lens), len(lens)
    limit = bound(s, T, B)
    measure = timer(cuda)
    case = "decode" if decode else "prefill"
    candidates = SWEEP["recurrent" if decode else form] if sweep else []
    rows = []
    for name, tiles in [("default", None)] + [(str(t), t) for t in candidates]:
        label = name if decode else f"{form} {name}"
        try:
            if decode:
                ms = measure(decode_step(x, tiles, cuda)) / layers
            else:
                ms = measure(lambda tiles=tiles: call(x, x["states"][0], form, tiles))
        except Exception as e:  # a candidate may not compile (resources); report and go on
            print(f"  {case:7} T={T:<5} {label}: failed: {type(e).__name__}: {e}"[:200])
            continue
        rows.append(dict(case=case, form="recurrent" if decode else form, tokens=T, batch=B,
                         tiles=name, ms=ms, **limit))  # fmt: skip
        us = {k: limit[k] * 1e3 for k in ("bound_ms", "bound_ms_hbm", "bound_ms_flops")}
        print(
            f"  {case:7} T={T:<5} B={B}  {ms * 1e3:9.1f} us  bound {us['bound_ms']:7.2f} us"
            f" (HBM {us['bound_ms_hbm']:.2f}, FLOPs {us['bound_ms_flops']:.2f})"
            f"  {ms / limit['bound_ms']:6.1f}x  {label}"
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m freetoken_agent.bench.gated_delta_kernel",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument("--no-sweep", action="store_true", help="time the default tiles only")
    parser.add_argument("--cpu", action="store_true", help="small shapes, Triton's interpreter")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (CUDA default: "
                        "bench/results/gated_delta_kernel.json)")  # fmt: skip
    args = parser.parse_args(argv)
    cuda = not args.cpu
    if cuda:
        assert torch.cuda.is_available(), "this benchmark needs a CUDA device (or --cpu)"
    else:  # the interpreter must be on before triton is first imported
        assert "triton" not in sys.modules or os.environ.get("TRITON_INTERPRET") == "1", (
            "--cpu needs TRITON_INTERPRET=1 before triton is imported"
        )
        os.environ["TRITON_INTERPRET"] = "1"
        torch.manual_seed(0)
    import triton

    s = SHAPES["cuda" if cuda else "cpu"]
    where = torch.cuda.get_device_name() if cuda else "CPU (Triton interpreter)"
    print(f"{where}  torch {torch.__version__}  triton {triton.__version__}")
    print(f"Hk={s['hk']} Hv={s['hv']} Dk={s['dk']} Dv={s['dv']} bf16, fp32 state; bounds at "
          f"{HBM_BYTES_PER_S / 1e12:.1f} TB/s and {FLOPS_PER_S / 1e12:.0f} TFLOP/s")  # fmt: skip
    sweep = cuda and not args.no_sweep
    rows = []
    for t in s["prefill"]:
        for form in ("chunk", "recurrent"):
            rows += run_case(s, form, [t], cuda, sweep)
    for b in s["decode"]:
        rows += run_case(s, "decode", [1] * b, cuda, sweep)
    out = args.out or (RESULTS / "gated_delta_kernel.json" if cuda else None)
    if out is not None:
        report = dict(device=where, torch=torch.__version__, triton=triton.__version__,
                      shape={k: s[k] for k in ("hk", "hv", "dk", "dv")},
                      hbm_bytes_per_s=HBM_BYTES_PER_S, flops_per_s=FLOPS_PER_S,
                      graph_layers=GRAPH_LAYERS, rows=rows)  # fmt: skip
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1))
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
