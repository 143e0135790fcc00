"""Skinny matmul for decode: y [M, N] = x [M, K] @ W [N, K]^T (+ b), M a handful of rows.

At decode a linear layer reads its whole weight for one to a few tokens, so its time is the
weight's bytes over HBM bandwidth. On the H200 the cuBLAS kernels torch picks for the 30B-A3B
projections at M = 1 ran at ~42% of the copy bandwidth (bench/results/profile_12l_s12.txt: qkv
7.7 us, o_proj 7.1 us + a split-K reduce, the 0.5 MB router 4.9 us). This kernel streams W once
in [BLOCK_N, BLOCK_K] tiles, coalesced along K, each program owning BLOCK_N output columns and
one of SPLIT_K slices of K; x's rows are loaded per tile (they stay in L1/L2) and multiplied
with the tile in one tensor-core dot (rows padded to 16), accumulated in fp32. With SPLIT_K > 1
the slices' fp32 partials are summed by a second launch (with the bias and the cast), so a
narrow W (the router's 128 rows) still spreads over the SMs; with one slice the kernel writes
the output itself.

Not yet used by the model: `bench gemv` measures it against torch's choice per shape first.
"""

# Shape legend: M rows of x (decode batch), N output features, K input features, S = SPLIT_K.

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from freetoken_agent.kernels.gemv import MAX_M  # rows a call takes (padded to 16 in the dot)
from freetoken_agent.kernels.triton.l2_prefetch import prefetch_lines
from freetoken_agent.kernels.triton.pdl import enter
from freetoken_agent.kernels.triton.pdl import launch as pdl_launch

SM_TARGET = 264  # programs to aim for: two waves of the H200's 132 SMs


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, N, K, k_per_split, stride_xm, stride_wn, stride_om,
    M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr,
    FINAL: tl.constexpr, HAS_BIAS: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """out[s, m, n] (fp32) = sum over the s-th K slice of x[m, k] * W[n, k]; with FINAL (one
    slice) out is y itself: the bias added, cast to y's dtype, no second launch. The M rows are
    padded to 16 for one tensor-core dot per tile: the tile of W is read once for all rows, and
    the padding costs arithmetic only, which a weight-bound matmul has to spare."""
    pid_n, s = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    k_lo = s * k_per_split
    _prefetch_tile(w_ptr, offs_n, n_ok, k_lo, tl.minimum(k_lo + k_per_split, K), stride_wn, PDL)
    enter(PDL)  # after the prefetch of the model's weights, before anything else: pdl.py
    offs_m = tl.arange(0, 16)
    m_ok = offs_m < M
    acc = _gemv_tile(x_ptr, w_ptr, offs_n, n_ok, offs_m, k_lo, tl.minimum(k_lo + k_per_split, K),
                     stride_xm, stride_wn, M, BLOCK_N, BLOCK_K, PREC)  # fmt: skip
    out = out_ptr + (s * M + offs_m[:, None]) * stride_om + offs_n[None, :]
    ok = m_ok[:, None] & n_ok[None, :]
    if FINAL:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        tl.store(out, acc, mask=ok)


@triton.jit
def _prefetch_tile(w_ptr, offs_n, n_ok, k_lo, k_hi, stride_wn, PDL: tl.constexpr):
    """The L2 prefetch (l2_prefetch.prefetch_lines) of the lines of W a program reads (rows
    offs_n, columns [k_lo, k_hi)), eight lines a row a step; with PDL's PREFETCH only (also
    kernels/triton/proj_norm.py's, and moe_decode.py's for the gate and up rows of a slot)."""
    if PDL & 4:  # PREFETCH
        line = 1024 // w_ptr.dtype.element_ty.primitive_bitwidth  # elements in 128 bytes
        w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
        for k0 in range(k_lo, k_hi, 8 * line):
            offs_k = k0 + tl.arange(0, 8) * line
            ok = n_ok[:, None] & (offs_k < k_hi)[None, :]
            prefetch_lines(w_rows + offs_k[None, :], ok, w_ptr)


@triton.jit
def _gemv_tile(x_ptr, w_ptr, offs_n, n_ok, offs_m, k_lo, k_hi, stride_xm, stride_wn,
               M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               PREC: tl.constexpr):  # fmt: skip
    """sum over k in [k_lo, k_hi) of x[m, k] * W[n, k] for the columns offs_n: [16, BLOCK_N]
    fp32, rows past M zero (also kernels/triton/proj_norm.py's)."""
    m_ok = offs_m < M
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    x_rows = x_ptr + offs_m[:, None] * stride_xm  # [16, 1]
    acc = tl.zeros([16, BLOCK_N], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < k_hi
        w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_rows + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PREC)  # [16, BLOCK_N]
    return acc


@triton.jit
def _sum_splits_kernel(
    part_ptr, b_ptr, y_ptr, N, stride_ym,
    M: tl.constexpr, S: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """y[m, n] = sum_s part[s, m, n] (+ b[n]), cast to y's dtype."""
    enter(PDL)  # first: pdl.py
    m, pid = tl.program_id(0), tl.program_id(1)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(S):
        acc += tl.load(part_ptr + (s * M + m) * N + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + m * stride_ym + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)


def gemv(
    x: Tensor, w: Tensor, bias: Tensor | None = None, *, tiles: dict[str, int] | None = None
) -> Tensor:
    """x [M, K] (M <= MAX_M, rows contiguous), w [N, K] (rows contiguous), bias [N] or None:
    y [M, N] in x's dtype. `tiles` overrides BLOCK_N, BLOCK_K, SPLIT_K, WARPS (the bench)."""
    m, k = x.shape
    n = w.shape[0]
    assert 1 <= m <= MAX_M, f"gemv takes 1..{MAX_M} rows, got {m}"
    assert w.shape[1] == k and x.stride(1) == 1 and w.stride(1) == 1, "K must be contiguous"
    c = choose_tiles(n, k, tiles)
    s, k_per_split = splits(k, c)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    # One slice: the kernel writes y; more: fp32 partials [S, M, N], summed by a second launch.
    part = y if s == 1 else torch.empty(s, m, n, dtype=torch.float32, device=x.device)
    _gemv_kernel[(triton.cdiv(n, c["BLOCK_N"]), s)](
        x, w, bias if bias is not None else w, part, n, k, k_per_split, x.stride(0),
        w.stride(0), n, M=m, BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"], num_warps=c["WARPS"],
        PREC="ieee" if x.dtype == torch.float32 else "tf32",  # fp32 stays exact
        FINAL=s == 1, HAS_BIAS=bias is not None,
        **pdl_launch(x.device, heavy=True, prefetch=True),
    )  # fmt: skip
    if s == 1:
        return y
    block = 1024
    _sum_splits_kernel[(m, triton.cdiv(n, block))](
        part, bias if bias is not None else part, y, n, y.stride(0),
        M=m, S=s, HAS_BIAS=bias is not None, BLOCK=block,
        **pdl_launch(x.device),
    )  # fmt: skip
    return y


def splits(k: int, tiles: dict[str, int]) -> tuple[int, int]:
    """(slices, K per slice) of a K-long reduction under `tiles`: SPLIT_K slices of whole
    BLOCK_K steps, fewer where the last ones would be empty."""
    k_per_split = triton.cdiv(triton.cdiv(k, tiles["SPLIT_K"]), tiles["BLOCK_K"]) * tiles["BLOCK_K"]
    return triton.cdiv(k, k_per_split), k_per_split


def choose_tiles(n: int, k: int, override: dict[str, int] | None = None) -> dict[str, int]:
    """Tiles for an [N, K] weight: 32 columns a program, 256-wide K steps (512 bytes of bf16
    per row a load), and K split until about SM_TARGET programs run."""
    c = {"BLOCK_N": 32, "BLOCK_K": 256, "WARPS": 4, "SPLIT_K": 1}
    programs = triton.cdiv(n, c["BLOCK_N"])
    c["SPLIT_K"] = max(1, min(SM_TARGET // programs, triton.cdiv(k, c["BLOCK_K"])))
    return {**c, **(override or {})}
