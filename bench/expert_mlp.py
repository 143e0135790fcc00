"""A measurement probe: one decode token's routed experts as ONE launch (gate/up, SwiGLU and
down in each program), against the engine's decode path (kernels/triton/moe_decode.py: gate/up,
down and the sum over k, three launches), each in a CUDA graph of 8 layers' rows at the
Qwen3-30B-A3B shape.

    python -m freetoken_agent.bench expert-mlp [--slices 16 32 64] [--tma-slices 32 64]
        [--fma-slices ...] [--read-chunks 12 24 48 96] [--rounds 3]

Why: at 48 layers, b=1, a resident layer spends ~67 us of kernels for ~30 us of HBM time, and
fusing small kernels of the chain no longer pays under PDL (NOTES, thirty-eighth session). The
MoE is 75.5 MB a layer in two weight-streaming launches (16.1 + 10.2 us in the twenty-second
session's table, 2.9 TB/s together). If the whole expert MLP in one grid streams faster, that
is the first part of a persistent layer kernel worth building; if not, that plan loses its
cheapest part. Nothing here is engine code: the kernel takes one token, resident rows only.

The probe's program (pair p, slice s of BI expert columns) computes act = silu(x W1^T) * (x
W3^T) for its columns over the whole hidden size, then that slice's down product act_s W2[:,
s]^T: an fp32 partial [H] of pair p. A second launch sums each pair's slices in order, weights
them and sums over k, rounding once: the engine's numbers up to the fp32 sum's order (act in
fp32, split into two 16-bit parts for the tensor cores, as moe_decode.py does).

Variants: the one launch with tensor cores (`--slices`), with its weight tiles loaded through
tensor descriptors (Hopper's TMA, `--tma-slices`), without tensor cores (`--fma-slices`), and
the same rows read with nothing computed (`--read-chunks`: the grid's read rate for these
bytes, the floor any MoE kernel of one launch stands on).

Found on the H200 (thirty-eighth session, NOTES): the engine 29.0-29.3 us a layer, one launch
29.4 (BI=64), through TMA 28.8, without tensor cores 68-105, the read alone 26.1 at best (768
programs): the MoE is within ~3 us a layer of one kernel's read, and one launch gains nothing.

JSON: `expert_mlp.json` (us a layer, GB/s and share of the copy bandwidth, per variant).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

from freetoken_agent.help_format import DefaultsHelpFormatter

RESULTS = Path(__file__).resolve().parent / "results"

# Shape legend: H hidden, I expert width, K top-k (pairs of the one token), S = I / BI slices.


@triton.jit
def _expert_mlp_kernel(
    x_ptr,  # [H] the token
    w13_ptr,  # [N, 2I, H]
    w2_ptr,  # [N, H, I]
    ids_ptr,  # [K] bank rows
    part_ptr,  # [K, S, H] fp32
    stride13,
    stride2,
    H,
    I,  # noqa: E741 (the shape legend's name)
    BI: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PREC: tl.constexpr,
):
    p, s = tl.program_id(0), tl.program_id(1)
    row = tl.load(ids_ptr + p).to(tl.int64)
    offs_i = s * BI + tl.arange(0, BI)
    i_ok = offs_i < I
    offs_m = tl.arange(0, 16)
    first = offs_m[:, None] == 0  # the token is the dot's row 0; rows 1-15 pad it to 16
    gate = w13_ptr + row * stride13 + offs_i[:, None] * H  # [BI, 1]
    up = gate + I * H
    g = tl.zeros([16, BI], tl.float32)
    u = tl.zeros([16, BI], tl.float32)
    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        h_ok = offs_h < H
        x = tl.load(x_ptr + offs_m[:, None] * 0 + offs_h[None, :], mask=first & h_ok[None, :],
                    other=0.0)  # [16, BLOCK_H]  # fmt: skip
        ok = i_ok[:, None] & h_ok[None, :]
        g = tl.dot(x, tl.trans(tl.load(gate + offs_h[None, :], mask=ok, other=0.0)), g,
                   input_precision=PREC)  # fmt: skip
        u = tl.dot(x, tl.trans(tl.load(up + offs_h[None, :], mask=ok, other=0.0)), u,
                   input_precision=PREC)  # fmt: skip
    act = g * tl.sigmoid(g) * u  # SwiGLU in fp32, [16, BI]
    hi = act.to(x_ptr.dtype.element_ty)
    lo = (act - hi.to(tl.float32)).to(x_ptr.dtype.element_ty)  # the rest, for 16-bit dots
    down = w2_ptr + row * stride2 + offs_i[None, :]  # [1, BI]
    part = part_ptr + (p * tl.num_programs(1) + s) * H
    for n0 in range(0, H, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < H
        w = tl.load(down + offs_n[:, None] * I, mask=n_ok[:, None] & i_ok[None, :], other=0.0)
        y = tl.dot(hi, tl.trans(w), input_precision=PREC)
        y = tl.dot(lo, tl.trans(w), y, input_precision=PREC)  # [16, BLOCK_N]
        tl.store(part + offs_m[:, None] * 0 + offs_n[None, :], y, mask=first & n_ok[None, :])


@triton.jit
def _expert_mlp_fma_kernel(
    x_ptr, w13_ptr, w2_ptr, ids_ptr, part_ptr, stride13, stride2, H,
    I,  # noqa: E741 (the shape legend's name)
    BI: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """_expert_mlp_kernel without tensor cores: one token needs no dot, so each tile is
    multiplied and reduced in fp32 registers (no 16-row padding, no act split)."""
    p, s = tl.program_id(0), tl.program_id(1)
    row = tl.load(ids_ptr + p).to(tl.int64)
    offs_i = s * BI + tl.arange(0, BI)
    i_ok = offs_i < I
    gate = w13_ptr + row * stride13 + offs_i[:, None] * H  # [BI, 1]
    up = gate + I * H
    g = tl.zeros([BI], tl.float32)
    u = tl.zeros([BI], tl.float32)
    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        h_ok = offs_h < H
        x = tl.load(x_ptr + offs_h, mask=h_ok, other=0.0).to(tl.float32)[None, :]
        ok = i_ok[:, None] & h_ok[None, :]
        g += tl.sum(tl.load(gate + offs_h[None, :], mask=ok, other=0.0).to(tl.float32) * x, 1)
        u += tl.sum(tl.load(up + offs_h[None, :], mask=ok, other=0.0).to(tl.float32) * x, 1)
    act = (g * tl.sigmoid(g) * u)[None, :]  # SwiGLU in fp32, [1, BI]
    down = w2_ptr + row * stride2 + offs_i[None, :]  # [1, BI]
    part = part_ptr + (p * tl.num_programs(1) + s) * H
    for n0 in range(0, H, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < H
        w = tl.load(down + offs_n[:, None] * I, mask=n_ok[:, None] & i_ok[None, :], other=0.0)
        tl.store(part + offs_n, tl.sum(w.to(tl.float32) * act, 1), mask=n_ok)


@triton.jit
def _expert_mlp_tma_kernel(
    x_ptr, w13_desc, w2_desc, ids_ptr, part_ptr, H,
    I,  # noqa: E741 (the shape legend's name)
    BI: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """_expert_mlp_kernel with its weight tiles loaded through tensor descriptors (Hopper's TMA:
    the copy engine of each SM moves a whole tile into shared memory, asynchronously), the
    banks seen as [N, 2I, H] and [N, H, I]."""
    p, s = tl.program_id(0), tl.program_id(1)
    row = tl.load(ids_ptr + p).to(tl.int32)  # descriptor offsets are 32-bit
    i0 = s * BI
    offs_m = tl.arange(0, 16)
    first = offs_m[:, None] == 0
    g = tl.zeros([16, BI], tl.float32)
    u = tl.zeros([16, BI], tl.float32)
    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        x = tl.load(x_ptr + offs_m[:, None] * 0 + offs_h[None, :],
                    mask=first & (offs_h < H)[None, :], other=0.0)  # fmt: skip
        wg = w13_desc.load([row, i0, h0]).reshape(BI, BLOCK_H)
        wu = w13_desc.load([row, I + i0, h0]).reshape(BI, BLOCK_H)
        g = tl.dot(x, tl.trans(wg), g, input_precision=PREC)
        u = tl.dot(x, tl.trans(wu), u, input_precision=PREC)
    act = g * tl.sigmoid(g) * u
    hi = act.to(x_ptr.dtype.element_ty)
    lo = (act - hi.to(tl.float32)).to(x_ptr.dtype.element_ty)
    part = part_ptr + (p * tl.num_programs(1) + s) * H
    for n0 in range(0, H, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        w = w2_desc.load([row, n0, i0]).reshape(BLOCK_N, BI)
        y = tl.dot(hi, tl.trans(w), input_precision=PREC)
        y = tl.dot(lo, tl.trans(w), y, input_precision=PREC)
        tl.store(part + offs_m[:, None] * 0 + offs_n[None, :], y,
                 mask=first & (offs_n < H)[None, :])  # fmt: skip


@triton.jit
def _read_rows_kernel(w13_ptr, w2_ptr, ids_ptr, sink_ptr, stride13, stride2, ROW13, ROW2,
                      CHUNKS: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """The read alone: program (p, c) streams chunk c of pair p's w13 and w2 rows (CHUNKS
    chunks a row) and keeps one fp32 sum (stored, so the loads stay): the rows' bytes at this
    grid's read rate, with nothing computed."""
    p, c = tl.program_id(0), tl.program_id(1)
    row = tl.load(ids_ptr + p).to(tl.int64)
    acc = tl.zeros([BLOCK], tl.float32)
    per13, per2 = tl.cdiv(ROW13, CHUNKS), tl.cdiv(ROW2, CHUNKS)
    end13, end2 = tl.minimum((c + 1) * per13, ROW13), tl.minimum((c + 1) * per2, ROW2)
    for o in range(c * per13, end13, BLOCK):
        offs = o + tl.arange(0, BLOCK)
        acc += tl.load(w13_ptr + row * stride13 + offs, mask=offs < end13, other=0.0).to(tl.float32)
    for o in range(c * per2, end2, BLOCK):
        offs = o + tl.arange(0, BLOCK)
        acc += tl.load(w2_ptr + row * stride2 + offs, mask=offs < end2, other=0.0).to(tl.float32)
    tl.store(sink_ptr + p * CHUNKS + c, tl.sum(acc, 0))


@triton.jit
def _sum_slices_kernel(part_ptr, wts_ptr, out_ptr, H, K: tl.constexpr, S: tl.constexpr,
                       BLOCK: tl.constexpr):  # fmt: skip
    """out[n] = sum over k of w_k * (sum over s of part[k, s, n]), in that order, rounded once."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < H
    acc = tl.zeros([BLOCK], tl.float32)
    for k in tl.static_range(K):
        y = tl.zeros([BLOCK], tl.float32)
        for s in range(S):
            y += tl.load(part_ptr + (k * S + s) * H + offs, mask=ok, other=0.0)
        acc += tl.load(wts_ptr + k) * y
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def expert_mlp(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    out: torch.Tensor | None = None,
    part: torch.Tensor | None = None,
    slice_width: int = 32,
    block_h: int = 128,
    block_n: int = 128,
    warps: int = 4,
    fma: bool = False,
    tma: bool = False,
) -> torch.Tensor:
    """sum_k weights[k] * expert(ids[k], x) for one token: x [1, H], w13 [N, 2I, H], w2 [N, H,
    I] (rows dense, any row stride), ids [K] distinct rows, weights [K] fp32; out [1, H] in x's
    dtype. `part`: a [K, S, H] fp32 scratch (a graph keeps its address). `fma`: the kernel
    without tensor cores; `tma`: the kernel loading its weight tiles through tensor descriptors
    (the slice width must divide I: a descriptor's tile would read the next gate row)."""
    k, h, i = ids.numel(), x.shape[1], w2.shape[2]
    slices = triton.cdiv(i, slice_width)
    assert x.shape[0] == 1 and w13.shape[1:] == (2 * i, h) and w2.shape[1:] == (h, i)
    assert w13.stride()[1:] == (h, 1) and w2.stride()[1:] == (i, 1), "dense rows"
    if part is None:
        part = torch.empty(k, slices, h, dtype=torch.float32, device=x.device)
    if out is None:
        out = torch.empty_like(x)
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        assert i % slice_width == 0, "a tile past I would read the up rows"
        d13 = TensorDescriptor(w13, list(w13.shape), list(w13.stride()), [1, slice_width, block_h])
        d2 = TensorDescriptor(w2, list(w2.shape), list(w2.stride()), [1, block_n, slice_width])
        _expert_mlp_tma_kernel[(k, slices)](
            x, d13, d2, ids, part, h, i,
            BI=slice_width, BLOCK_H=block_h, BLOCK_N=block_n, PREC=prec, num_warps=warps,
        )  # fmt: skip
    elif fma:
        _expert_mlp_fma_kernel[(k, slices)](
            x, w13, w2, ids, part, w13.stride(0), w2.stride(0), h, i,
            BI=slice_width, BLOCK_H=block_h, BLOCK_N=block_n, num_warps=warps,
        )  # fmt: skip
    else:
        _expert_mlp_kernel[(k, slices)](
            x, w13, w2, ids, part, w13.stride(0), w2.stride(0), h, i,
            BI=slice_width, BLOCK_H=block_h, BLOCK_N=block_n, PREC=prec, num_warps=warps,
        )  # fmt: skip
    block = 128
    _sum_slices_kernel[(triton.cdiv(h, block),)](part, weights, out, h, K=k, S=slices,
                                                 BLOCK=block)  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="freetoken bench expert-mlp",
        description=__doc__,
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument("--slices", type=int, nargs="+", default=[16, 32, 64],
                        help="expert columns a program computes (BI)")  # fmt: skip
    parser.add_argument("--fma-slices", type=int, nargs="*", default=[],
                        help="BI of the variants without tensor cores (68-105 us a layer on "
                        "the H200: far slower)")  # fmt: skip
    parser.add_argument("--tma-slices", type=int, nargs="*", default=[32, 64],
                        help="BI of the variants loading through tensor descriptors")  # fmt: skip
    parser.add_argument("--read-chunks", type=int, nargs="*", default=[12, 24, 48, 96],
                        help="chunks a pair's rows are read in by the read-only rows (8 pairs: "
                        "8 x this many programs)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3, help="turns of every variant")
    parser.add_argument("--out", type=Path, default=RESULTS, help="JSON results folder")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("this benchmark needs CUDA")
    from freetoken_agent.bench.cuda_graph import captured, rotated_times, rows_beside_copy
    from freetoken_agent.bench.limits import hbm_copy_bandwidth
    from freetoken_agent.bench.moe_kernel import (
        GRAPH_LAYERS,
        SHAPES,
        make_banks,
        make_tokens,
        row_bytes,
    )
    from freetoken_agent.kernels.triton.fused_moe import fused_moe_decode

    s = SHAPES["qwen3-30b-a3b"]
    hbm = hbm_copy_bandwidth(torch.device("cuda"))
    w13, w2 = make_banks(s, GRAPH_LAYERS)
    hidden, ids, wts = make_tokens(s, 1, seed=1)
    nbytes = row_bytes(ids, s)
    layer_ids = [(ids[0] + layer * s["n"]).contiguous() for layer in range(GRAPH_LAYERS)]
    outs = [torch.empty_like(hidden) for _ in layer_ids]
    want = fused_moe_decode(hidden, w13, w2, ids, wts)
    steps = {"engine (3 launches)": lambda: [
        fused_moe_decode(hidden, w13, w2, lid[None], wts, out)
        for lid, out in zip(layer_ids, outs, strict=True)
    ]}  # fmt: skip
    variants = [(bi, "") for bi in args.slices] + [(bi, "fma") for bi in args.fma_slices]
    variants += [(bi, "tma") for bi in args.tma_slices]
    for bi, kind in variants:
        name = f"one launch{', ' + kind if kind else ''}, BI={bi}"
        fma, tma = kind == "fma", kind == "tma"
        parts = [torch.empty(s["k"], triton.cdiv(s["i"], bi), s["h"], dtype=torch.float32,
                             device="cuda") for _ in layer_ids]  # fmt: skip
        try:
            got = expert_mlp(hidden, w13, w2, ids[0], wts[0], slice_width=bi, fma=fma, tma=tma)
        except Exception as e:  # a variant may not compile on this Triton: report, go on
            print(f"{name}: failed: {type(e).__name__}: {e}"[:300], flush=True)
            continue
        err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
        print(f"{name}: max error against the engine's {err:.2e} of its largest output")
        steps[name] = lambda bi=bi, fma=fma, tma=tma, parts=parts: [
            expert_mlp(hidden, w13, w2, lid, wts[0], out, part, slice_width=bi, fma=fma, tma=tma)
            for lid, out, part in zip(layer_ids, outs, parts, strict=True)
        ]
    rows13, rows2 = w13[0].numel(), w2[0].numel()
    for chunks in args.read_chunks:  # the read alone: this grid's rate for the same bytes
        sink = torch.empty(s["k"] * chunks, dtype=torch.float32, device="cuda")
        steps[f"read only, {s['k'] * chunks} programs"] = lambda chunks=chunks, sink=sink: [
            _read_rows_kernel[(s["k"], chunks)](
                w13, w2, lid, sink, w13.stride(0), w2.stride(0), rows13, rows2,
                CHUNKS=chunks, BLOCK=2048, num_warps=4,
            )
            for lid in layer_ids
        ]  # fmt: skip
    replays = {name: captured(step) for name, step in steps.items()}
    times = rotated_times(replays, args.rounds, GRAPH_LAYERS)
    report = {"bench": "expert-mlp", "hbm_copy_gb_s": hbm / 1e9, "layer_mb": nbytes / 1e6,
              "rows": rows_beside_copy(times, nbytes, hbm)}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "expert_mlp.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
