"""A decode step's attention front in one launch: the layer's input RMSNorm (with the residual
add before it), the stacked q/k/v projection, the per-head q/k norms, RoPE and the KV store.

Why: at decode these are three launches a layer (the norm kernel, cuBLAS's qkv GEMV, and
kernels/triton/rope.py's qk-norm/RoPE/store), 2.2 + 7.8 + 2.5 us on the H200 at the 30B-A3B
shape (bench/results/NOTES.md, twenty-second session), the two small ones latency-bound; 48
times a step. Here the skinny matmul's programs (kernels/triton/gemv.py: BLOCK_N columns, one
of SPLIT_K slices of K each) normalise the rows they multiply as they load them, and the last
program to finish a head (an acquire-release counter per head at GPU scope, as kernels/triton/
proj_norm.py's) sums the head's fp32 partials in a fixed order, rounds them to the model dtype
(F.linear's output) and runs rope.py's per-head norm and rotation on them: q heads to the new q
tensor, k heads (and v heads, raw) into the paged cache at the token's slot. Then it puts the
head's counter back to 0.

The norm: every program computes each row's rstd over the whole row (x + residual, ~4 KB a row
from L2, the norm kernel's own row code and rounding), then normalises each [rows, BLOCK_K]
tile of it as it loads it; program (0, 0) writes the residual stream s. No program waits for
another before the epilogue, so a layer's weights stream from its first instruction.

Numerics: s and the normalised rows are the norm kernel's (the sum of squares may differ in its
last fp32 bit, reduction order); the projection is an fp32 sum in another order than cuBLAS's,
rounded to the model dtype, so an element can land one ulp of that dtype away from F.linear's;
from there, every rounding is rope.py's.

Shape legend: M tokens (<= kernels/gemv.py MAX_M), H hidden (K of the projection, <= MAX_H),
Hq / Hkv query / kv heads, D head dim (D_PAD: padded to a power of two), NQKV = (Hq + 2 Hkv) D
projection rows, S = SPLIT_K, P pages of PS slots.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from freetoken_agent.kernels.gemv import MAX_M
from freetoken_agent.kernels.norm_qkv import MAX_H
from freetoken_agent.kernels.triton.gemv import _prefetch_tile, choose_tiles, splits
from freetoken_agent.kernels.triton.norm import (
    _load_sum,
    _row_rstd,
    _scale,
    round_mode,
    round_to,
)
from freetoken_agent.kernels.triton.pdl import enter
from freetoken_agent.kernels.triton.pdl import launch as pdl_launch
from freetoken_agent.kernels.triton.rope import _norm_rope_values, _rotary_dims


@triton.jit
def _rstd_rows(x_ptr, r_ptr, stride_xm, stride_r, inv_h, eps, H, s_ptr, WRITE_S,
               M: tl.constexpr, ROW: tl.constexpr, HAS_RES: tl.constexpr,
               MODE: tl.constexpr):  # fmt: skip
    """[16] fp32: each row's 1 / rms of s = round(x + residual) (or x), rows past M 0; with
    WRITE_S (one program) s itself is stored [M, H]."""
    offs = tl.arange(0, ROW)
    ok = offs < H
    offs_m = tl.arange(0, 16)
    rstd = tl.zeros([16], tl.float32)
    for m in tl.static_range(M):
        row = _load_sum(x_ptr + m * stride_xm, r_ptr + m * stride_r, offs, ok, HAS_RES, MODE)
        if HAS_RES & WRITE_S:
            tl.store(s_ptr + m * H + offs, row.to(s_ptr.dtype.element_ty), mask=ok)
        rstd = tl.where(offs_m == m, _row_rstd(row, inv_h, eps), rstd)
    return rstd


@triton.jit
def _normed_gemv_tile(x_ptr, r_ptr, nw_ptr, w_ptr, rstd, offs_n, n_ok, k_lo, k_hi, stride_xm,
                      stride_r, stride_wn, M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, PREC: tl.constexpr, HAS_RES: tl.constexpr,
                      MODE: tl.constexpr, ZERO_CENTRED: tl.constexpr):  # fmt: skip
    """gemv.py's _gemv_tile with x replaced by the normalised rows h = norm(round(x + r)), made
    tile by tile from x, r and rstd [16]: [16, BLOCK_N] fp32, rows past M zero. Only the M real
    rows are normalised (the dot's padding rows stay 0): normalising all 16 made the kernel
    compute-bound (the first device run: 8 us a layer slower than the three launches)."""
    offs_m = tl.arange(0, 16)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    acc = tl.zeros([16, BLOCK_N], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < k_hi
        w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        h = tl.zeros([16, BLOCK_K], tl.float32)
        for m in tl.static_range(M):
            rstd_m = tl.sum(tl.where(offs_m == m, rstd, 0.0), 0)  # this row's 1 / rms
            s_m = _load_sum(x_ptr + m * stride_xm, r_ptr + m * stride_r, offs_k, k_ok, HAS_RES,
                            MODE)  # [BLOCK_K]  # fmt: skip
            h_m = _scale(s_m, rstd_m, nw_ptr, offs_k, k_ok, ZERO_CENTRED, MODE)
            h = tl.where(offs_m[:, None] == m, h_m[None, :], h)
        acc = tl.dot(h.to(w.dtype), tl.trans(w), acc, input_precision=PREC)  # [16, BLOCK_N]
    return acc


@triton.jit
def _head_out(part_ptr, m, head, N, eps, inv_d, pos_ptr, cos_ptr, sin_ptr, stride_cos,
              stride_sin, q_w_ptr, k_w_ptr, q_out_ptr, stride_qt, stride_qh, k_cache_ptr,
              v_cache_ptr, slot_ptr, page_size, stride_cp, stride_cs, stride_ch, n_heads,
              n_kv_heads, M: tl.constexpr, S: tl.constexpr, HEAD_DIM: tl.constexpr,
              D_PAD: tl.constexpr, ROT: tl.constexpr, Q_NORM: tl.constexpr,
              K_NORM: tl.constexpr, MODE: tl.constexpr):  # fmt: skip
    """Row m of one head: its partials summed in slice order and rounded (F.linear's output),
    then rope.py's norm and rotation (q, k) or nothing (v), stored where it goes."""
    offs_d, d_ok, in_rot, first_half, partner = _rotary_dims(HEAD_DIM, D_PAD, ROT)
    y = tl.zeros([D_PAD], tl.float32)
    yp = tl.zeros([D_PAD], tl.float32)
    col = head * HEAD_DIM
    for j in tl.static_range(S):  # slice order: the same sum every launch
        base = part_ptr + (j * M + m) * N + col
        y += tl.load(base + offs_d, mask=d_ok, other=0.0, cache_modifier=".cg")
        yp += tl.load(base + partner, mask=d_ok, other=0.0, cache_modifier=".cg")
    y = round_to(y, MODE)[None, :]  # [1, D_PAD]
    yp = round_to(yp, MODE)[None, :]
    pos = tl.load(pos_ptr + m)
    cos_row, sin_row = cos_ptr + pos * stride_cos, sin_ptr + pos * stride_sin
    slot = tl.load(slot_ptr + m)
    cache_off = (slot // page_size) * stride_cp + (slot % page_size) * stride_cs
    if head < n_heads:
        out = _norm_rope_values(y, yp, q_w_ptr, cos_row, sin_row, offs_d, d_ok, in_rot,
                                first_half, partner, eps, inv_d, Q_NORM, MODE)  # fmt: skip
        dst = q_out_ptr + m * stride_qt + head * stride_qh
    elif head < n_heads + n_kv_heads:
        out = _norm_rope_values(y, yp, k_w_ptr, cos_row, sin_row, offs_d, d_ok, in_rot,
                                first_half, partner, eps, inv_d, K_NORM, MODE)  # fmt: skip
        dst = k_cache_ptr + cache_off + (head - n_heads) * stride_ch
    else:  # v: the projection as it is
        out = y
        dst = v_cache_ptr + cache_off + (head - n_heads - n_kv_heads) * stride_ch
    tl.store(dst + offs_d[None, :], out.to(dst.dtype.element_ty), mask=d_ok[None, :])


@triton.jit
def _norm_qkv_kernel(
    x_ptr, r_ptr, nw_ptr, w_ptr, part_ptr, done_ptr, s_ptr,
    pos_ptr, cos_ptr, sin_ptr, q_w_ptr, k_w_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    H, N, k_per_split, stride_xm, stride_r, stride_wn, inv_h, eps, qk_eps, inv_d,
    stride_cos, stride_sin, stride_qt, stride_qh, page_size, stride_cp, stride_cs, stride_ch,
    n_heads, n_kv_heads,
    M: tl.constexpr, S: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ROW: tl.constexpr, PREC: tl.constexpr, MODE: tl.constexpr, HAS_RES: tl.constexpr,
    ZERO_CENTRED: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, ROT: tl.constexpr,
    Q_NORM: tl.constexpr, K_NORM: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    pid_n, s = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    k_lo = s * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, H)
    _prefetch_tile(w_ptr, offs_n, n_ok, k_lo, k_hi, stride_wn, PDL)
    enter(PDL)  # after the prefetch of the model's weights, before anything else: pdl.py
    first = (pid_n == 0) & (s == 0)
    rstd = _rstd_rows(x_ptr, r_ptr, stride_xm, stride_r, inv_h, eps, H, s_ptr, first,
                      M, ROW, HAS_RES, MODE)  # fmt: skip
    acc = _normed_gemv_tile(x_ptr, r_ptr, nw_ptr, w_ptr, rstd, offs_n, n_ok, k_lo, k_hi,
                            stride_xm, stride_r, stride_wn, M, BLOCK_N, BLOCK_K, PREC, HAS_RES,
                            MODE, ZERO_CENTRED)  # fmt: skip
    offs_m = tl.arange(0, 16)
    part = part_ptr + (s * M + offs_m[:, None]) * N + offs_n[None, :]
    tl.store(part, acc, mask=(offs_m[:, None] < M) & n_ok[None, :])
    # A head's partials are ordered before its counter's add (release); the last program's
    # loads after it (acquire, past L1) see every program's. BLOCK_N divides D: a column block
    # lies in one head.
    head = (pid_n * BLOCK_N) // HEAD_DIM
    arrivals = (HEAD_DIM // BLOCK_N) * S
    if tl.atomic_add(done_ptr + head, 1, sem="acq_rel", scope="gpu") == arrivals - 1:
        tl.store(done_ptr + head, 0)
        for m in range(M):
            _head_out(part_ptr, m, head, N, qk_eps, inv_d, pos_ptr, cos_ptr, sin_ptr,
                      stride_cos, stride_sin, q_w_ptr, k_w_ptr, q_out_ptr, stride_qt, stride_qh,
                      k_cache_ptr, v_cache_ptr, slot_ptr, page_size, stride_cp, stride_cs,
                      stride_ch, n_heads, n_kv_heads, M, S, HEAD_DIM, D_PAD, ROT, Q_NORM,
                      K_NORM, MODE)  # fmt: skip


def head_tiles(head_dim: int, n: int, k: int, override: dict[str, int] | None = None):
    """The skinny matmul's tiles for an [n, k] weight (gemv.py choose_tiles), with BLOCK_N cut
    to divide the head dim (a column block must lie in one head); None when no tile of 16 or
    more columns does."""
    tiles = choose_tiles(n, k, override)
    block = tiles["BLOCK_N"]
    while block >= 16 and head_dim % block:
        block //= 2
    if block < 16:
        return None
    if block != tiles["BLOCK_N"]:
        tiles = choose_tiles(n, k, {**(override or {}), "BLOCK_N": block})
    return tiles


def new_scratch(
    n_heads_total: int,
    head_dim: int,
    hidden: int,
    rows: int,
    device: torch.device,
    tiles: dict[str, int] | None = None,
) -> tuple[Tensor, Tensor]:
    """A layer's scratch: fp32 partials [S * rows * NQKV] and a counter a head (0 between
    launches). Full size at once: a captured graph keeps their addresses. `rows`: the most
    tokens a launch will take (<= MAX_M); `tiles`: the overrides the launches will pass."""
    n = n_heads_total * head_dim
    chosen = head_tiles(head_dim, n, hidden, tiles)
    assert chosen is not None, f"no column tile divides head dim {head_dim}"
    s = splits(hidden, chosen)[0]
    part = torch.zeros(s * rows * n, dtype=torch.float32, device=device)
    return part, torch.zeros(n_heads_total, dtype=torch.int32, device=device)


def norm_qkv_rope(
    x: Tensor,
    residual: Tensor | None,
    norm_weight: Tensor,
    eps: float,
    zero_centred: bool,
    w_qkv: Tensor,
    positions: Tensor,
    cos: Tensor,
    sin: Tensor,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    q_norm_weight: Tensor | None,
    k_norm_weight: Tensor | None,
    qk_eps: float,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    scratch: tuple[Tensor, Tensor] | None = None,
    tiles: dict[str, int] | None = None,
) -> tuple[Tensor, Tensor]:
    """(q, s) as kernels/norm_qkv.py's twin gives them, in one launch (module docstring).
    `scratch`: new_scratch's for this layer's shape, rows and `tiles` (a new one when None)."""
    m, h = x.shape
    hq, hkv, d = n_heads, n_kv_heads, head_dim
    heads = hq + 2 * hkv
    n = heads * d
    r = cos.shape[-1]
    assert 1 <= m <= MAX_M and h <= MAX_H and w_qkv.shape == (n, h), (x.shape, w_qkv.shape)
    assert x.stride(1) == 1 and w_qkv.stride(1) == 1 and norm_weight.shape == (h,)
    assert residual is None or (residual.shape == (m, h) and residual.stride(1) == 1)
    assert x.dtype == w_qkv.dtype == norm_weight.dtype == cos.dtype == sin.dtype
    assert cos.shape == sin.shape and 0 < r <= d and r % 2 == 0, (cos.shape, d)
    assert cos.stride(1) == 1 and sin.stride(1) == 1, "cos / sin rows must be contiguous"
    assert positions.shape == (m,) and slot_mapping.shape == (m,), (positions.shape, m)
    assert k_cache.dim() == 4 and k_cache.shape[2:] == (hkv, d), (k_cache.shape, hkv, d)
    assert v_cache.shape == k_cache.shape and v_cache.stride() == k_cache.stride(), "cache layout"
    assert k_cache.stride(3) == 1 and k_cache.dtype == x.dtype, "[Hkv, D] per slot, dense"
    for w in (q_norm_weight, k_norm_weight):
        assert w is None or (w.shape == (d,) and w.dtype == x.dtype and w.is_contiguous()), w
    tiles = head_tiles(d, n, h, tiles)
    assert tiles is not None, f"no column tile divides head dim {d}"
    s, k_per_split = splits(h, tiles)
    part, done = scratch if scratch is not None else new_scratch(heads, d, h, m, x.device, tiles)
    assert part.numel() >= s * m * n and done.numel() >= heads, "scratch made for another shape"
    q = torch.empty((m, hq, d), dtype=x.dtype, device=x.device)
    out_s = torch.empty_like(x) if residual is not None else x
    _norm_qkv_kernel[(triton.cdiv(n, tiles["BLOCK_N"]), s)](
        x, residual if residual is not None else x, norm_weight, w_qkv, part, done, out_s,
        positions, cos, sin,
        q_norm_weight if q_norm_weight is not None else x,  # never read without a norm
        k_norm_weight if k_norm_weight is not None else x,
        q, k_cache, v_cache, slot_mapping,
        h, n, k_per_split, x.stride(0), residual.stride(0) if residual is not None else 0,
        w_qkv.stride(0), 1.0 / h, eps, qk_eps, 1.0 / d,
        cos.stride(0), sin.stride(0), q.stride(0), q.stride(1), k_cache.shape[1],
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), hq, hkv,
        M=m, S=s, BLOCK_N=tiles["BLOCK_N"], BLOCK_K=tiles["BLOCK_K"],
        ROW=triton.next_power_of_2(h), PREC="ieee" if x.dtype == torch.float32 else "tf32",
        MODE=round_mode(x.dtype), HAS_RES=residual is not None, ZERO_CENTRED=zero_centred,
        HEAD_DIM=d, D_PAD=triton.next_power_of_2(d), ROT=r,
        Q_NORM=q_norm_weight is not None, K_NORM=k_norm_weight is not None,
        num_warps=tiles["WARPS"],
        **pdl_launch(x.device, heavy=True, prefetch=True, lead=True),
    )  # fmt: skip
    return q, out_s
