"""A measurement probe's kernel: a decode token's attention half of a layer (the input norm with
the residual add, the q/k/v projection, per-head q/k norms, RoPE and the K/V store, attention
over the cache, o_proj, the residual add and the post-attention norm) as ONE persistent grid,
its phases separated by grid-wide counters instead of kernel boundaries (`bench
attention-half`; not engine code).

Why: at 48 layers, b=1, a resident layer spends ~67 us of kernels for ~30 us of HBM time; the
MoE half is within ~3 us of what one kernel can read (`bench expert-mlp`, thirty-eighth
session), so what is left is the attention half: five launches (norm, qkv, rope, attention,
o_proj + norm), ~30 us for ~38 MB of weights. Three ways of reading o_proj's weight into L2
ahead of its kernel lost. Here every program loads its first o_proj tiles into registers
(AHEAD of them, 0-4) before it waits for the attention phase, so HBM streams through the latency-
bound middle of the layer, and no kernel boundary drains the grid between phases. L2 (bits):
1 asks L2 for the program's qkv rows before the norm, 2 for its other o_proj rows before the
waits (`prefetch.global.L2`: no registers held). STREAM runs each program's projection tiles
as one pipelined loop (`_stream_tiles`) instead of a loop per tile.

The grid: P programs, at most one wave (the SM count), all resident at once: a program that
spins at a counter never keeps another from running, so the waits cannot deadlock. Phases:
  1. every program normalises the row itself (4 KB read, no wait needed: s = round(x + r)),
     keeps its own copy in `xn` (a row of [P, H]) and computes qkv tiles (BN1 rows x one of
     KS1 slices of H, round-robin) as fp32 partials [KS1, NQKV].
  2. program (g, j), g < NKV, j < NS: sums the partials of its kv head's q rows and of k, v
     (in slice order, rounded to the model dtype), applies the q/k norms and RoPE (the rope
     kernel's `_norm_rope_values`), stores k and v at the new position (j = 0), and attends
     over the cached positions of its split; the last split adds the new token from
     registers (no program reads the cache slot being written). The last split of a kv head
     to finish (acquire-release counter) combines the NS partials into the attention output.
  3. o_proj tiles (BN3 rows x one of KS3 slices of NQ D) as fp32 partials [KS3, H]; the last
     program to finish sums them in slice order, rounds, adds the residual (rounded), and
     runs the norm kernel's row code (kernels/triton/norm.py), then puts the counters back.
PHASE 0 runs all three with waits between them; PHASE 1, 2, 3 run one each, as three
launches (the same code with kernel boundaries: the interpreter's tests, and the probe's
`phases` row). Triton's interpreter runs programs one after another, so a wait cannot run on
the CPU at all: PHASE 0 is CUDA only.

Numerics: the engine's rounding points (the norm's, the projection's output, q/k after their
norms and RoPE, the o_proj output, the residual add); the sums run in other orders than
cuBLAS's and the attention kernel's, so values can land an ulp of the model dtype away.

Shape legend: H hidden, D head dim, NQ / NKV query / kv heads (G = NQ / NKV per kv head),
NQKV = (NQ + 2 NKV) D, NS attention splits per kv head, P programs.
"""

from __future__ import annotations

import triton
import triton.language as tl

from freetoken_agent.kernels.triton.gemv import _gemv_tile, _prefetch_tile
from freetoken_agent.kernels.triton.norm import (
    _load_sum,
    _normalise_row,
    _row_rstd,
    _scale,
    round_to,
)
from freetoken_agent.kernels.triton.rope import _norm_rope_values, _rotary_dims

# count_ptr's words: [0] phase-1 arrivals, [1] kv heads combined, [2] phase-3 arrivals,
# [COUNT_HEADS + g] kv head g's finished splits.
COUNT_WORDS = 4  # the host's int of COUNT_HEADS
COUNT_HEADS = tl.constexpr(COUNT_WORDS)


@triton.jit
def _arrive(ptr):
    """One arrival of this program, after every store of all its threads (the barrier first:
    the release orders only what the arriving thread has seen)."""
    tl.debug_barrier()
    tl.atomic_add(ptr, 1, sem="release", scope="gpu")


@triton.jit
def _wait_for(ptr, target):
    """Spin until *ptr reaches target, then order this program's later loads after it."""
    n = tl.load(ptr, volatile=True)
    while n < target:
        n = tl.load(ptr, volatile=True)
    tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _sum_slices(part_ptr, offs, mask, NQKV: tl.constexpr, KS1: tl.constexpr, MODE: tl.constexpr):
    """The projection's output at offs (fp32, rounded to the model dtype): its KS1 fp32
    partials summed in slice order."""
    acc = tl.zeros(offs.shape, tl.float32)
    for ks in tl.static_range(KS1):
        acc += tl.load(part_ptr + ks * NQKV + offs, mask=mask, other=0.0, cache_modifier=".cg")
    return round_to(acc, MODE)


@triton.jit
def _o_tile(w, tile, a_ptr, part_ptr, offs_m,
            H: tl.constexpr, NQD: tl.constexpr, BN3: tl.constexpr, BK3: tl.constexpr,
            PREC: tl.constexpr):  # fmt: skip
    """o_proj's tile `tile` (w [BN3, BK3] its weights, zeros past the last tile): the fp32
    partial of its rows over its slice of the attention output."""
    n_blocks = H // BN3
    offs_n = (tile % n_blocks) * BN3 + tl.arange(0, BN3)
    k0 = (tile // n_blocks) * BK3
    offs_k = k0 + tl.arange(0, BK3)
    first = offs_m[:, None] == 0  # the token is the dot's row 0; rows 1-15 pad it to 16
    a = tl.load(a_ptr + offs_m[:, None] * 0 + offs_k[None, :], mask=first, other=0.0,
                cache_modifier=".cg")  # [16, BK3]  # fmt: skip
    acc = tl.dot(a, tl.trans(w), input_precision=PREC)  # [16, BN3], rows 1-15 zero
    ok = offs_n * 0 + tile < n_blocks * (NQD // BK3)  # [BN3] (a tensor: the interpreter's mask)
    tl.store(part_ptr + (tile // n_blocks) * H + offs_n, tl.sum(acc, 0), mask=ok)


@triton.jit
def _stream_tiles(x_ptr, w_ptr, part_ptr, first, step, offs_m,
                  N: tl.constexpr, K: tl.constexpr, BN: tl.constexpr, KS: tl.constexpr,
                  BK: tl.constexpr, PREC: tl.constexpr):  # fmt: skip
    """Tiles first, first + step, ... of an [N, K] weight (BN rows x one of KS slices of K
    each) as ONE loop of BK-wide steps (the persistent matmul's flattening), so Triton's
    pipeliner keeps loads in flight across tile boundaries where a loop per tile drains at
    each: each tile's fp32 partial of x . W rows over its slice lands in part [KS, N]. x: a
    row [K] (written by other programs: read past L1)."""
    n_blocks: tl.constexpr = N // BN
    steps: tl.constexpr = K // KS // BK
    mine = tl.maximum((n_blocks * KS - first + step - 1) // step, 0)
    offs_k = tl.arange(0, BK)
    first_row = offs_m[:, None] == 0  # the token is the dot's row 0; rows 1-15 pad it to 16
    acc = tl.zeros([16, BN], tl.float32)
    for i in range(0, mine * steps):
        t = first + (i // steps) * step
        kk = i % steps
        offs_n = (t % n_blocks) * BN + tl.arange(0, BN)
        k0 = (t // n_blocks) * (K // KS) + kk * BK
        w = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * K + k0 + offs_k[None, :])
        x = tl.load(x_ptr + offs_m[:, None] * 0 + k0 + offs_k[None, :], mask=first_row,
                    other=0.0, cache_modifier=".cg")  # fmt: skip
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PREC)  # [16, BN], rows 1-15 zero
        if kk == steps - 1:
            tl.store(part_ptr + (t // n_blocks) * N + offs_n, tl.sum(acc, 0))
            acc = tl.zeros([16, BN], tl.float32)


@triton.jit
def _load_o_tile(wo_ptr, tile, H: tl.constexpr, NQD: tl.constexpr, BN3: tl.constexpr,
                 BK3: tl.constexpr):  # fmt: skip
    """o_proj's weights of tile `tile` [BN3, BK3] (zeros past the last tile)."""
    n_blocks = H // BN3
    offs_n = (tile % n_blocks) * BN3 + tl.arange(0, BN3)
    offs_k = (tile // n_blocks) * BK3 + tl.arange(0, BK3)
    ok = offs_n * 0 + tile < n_blocks * (NQD // BK3)  # [BN3] (a tensor: the interpreter's mask)
    return tl.load(wo_ptr + offs_n.to(tl.int64)[:, None] * NQD + offs_k[None, :],
                   mask=ok[:, None], other=0.0)  # fmt: skip


@triton.jit
def _attention_half_kernel(
    x_ptr, r_ptr,  # [H] the layer's input and the residual stream
    w_in_ptr, w_post_ptr,  # [H] the input and post-attention norms' weights
    wqkv_ptr,  # [NQKV, H]
    wo_ptr,  # [H, NQ D]
    qn_ptr, kn_ptr,  # [D] the per-head q and k norms' weights
    cos_ptr, sin_ptr,  # [max_pos, D] RoPE tables (full rotary)
    pos_ptr,  # [1] int64: the new token's position (= the tokens cached before it)
    k_cache_ptr, v_cache_ptr,  # [>= pos + 1, NKV, D]: the engine's pages, in order
    xn_ptr,  # [P, H] each program's normalised row
    qkv_part_ptr,  # [KS1, NQKV] fp32
    att_acc_ptr, att_ml_ptr,  # [NKV, NS, 16, D], [NKV, NS, 2, 16] fp32
    attn_ptr,  # [NQ D] the attention output (model dtype)
    o_part_ptr,  # [KS3, H] fp32
    h_ptr, s_ptr,  # [H] out: the normalised row, the residual stream
    count_ptr,  # [COUNT_HEADS + NKV] int32, 0 between launches
    eps, qk_eps, inv_h, inv_d, scale, stride_cos,
    H: tl.constexpr, ROW: tl.constexpr, D: tl.constexpr, NQ: tl.constexpr, NKV: tl.constexpr,
    BN1: tl.constexpr, KS1: tl.constexpr, BK: tl.constexpr, NS: tl.constexpr,
    BL: tl.constexpr, BN3: tl.constexpr, KS3: tl.constexpr, AHEAD: tl.constexpr,
    PHASE: tl.constexpr, MODE: tl.constexpr, PREC: tl.constexpr, L2: tl.constexpr = 0,
    STREAM: tl.constexpr = 0,
):  # fmt: skip
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    offs_m = tl.arange(0, 16)
    NQKV: tl.constexpr = (NQ + 2 * NKV) * D
    NQD: tl.constexpr = NQ * D
    G: tl.constexpr = NQ // NKV
    BK3: tl.constexpr = NQD // KS3
    offs = tl.arange(0, ROW)
    row_ok = offs < H

    n_blocks1 = NQKV // BN1
    if L2 & 1 and (PHASE == 0 or PHASE == 1):  # this program's qkv rows, asked of L2 first
        for t in range(pid, n_blocks1 * KS1, n_programs):
            offs_n = (t % n_blocks1) * BN1 + tl.arange(0, BN1)
            k_lo = (t // n_blocks1) * (H // KS1)
            _prefetch_tile(wqkv_ptr, offs_n, offs_n < NQKV, k_lo, k_lo + H // KS1, H, 4)
    if PHASE == 0 or PHASE == 1:  # the input norm and the q/k/v projection
        s = _load_sum(x_ptr, r_ptr, offs, row_ok, True, MODE)  # round(x + r)
        xn = _scale(s, _row_rstd(s, inv_h, eps), w_in_ptr, offs, row_ok, False, MODE)
        xn_row = xn_ptr + pid * H
        tl.store(xn_row + offs, xn.to(xn_ptr.dtype.element_ty), mask=row_ok)
        if pid == 0:
            tl.store(s_ptr + offs, s.to(s_ptr.dtype.element_ty), mask=row_ok)
        tl.debug_barrier()  # the row's stores before any thread's loads of it
        if STREAM:
            _stream_tiles(xn_row, wqkv_ptr, qkv_part_ptr, pid, n_programs, offs_m, NQKV, H,
                          BN1, KS1, BK, PREC)  # fmt: skip
        else:
            for t in range(pid, n_blocks1 * KS1, n_programs):
                offs_n = (t % n_blocks1) * BN1 + tl.arange(0, BN1)
                k_lo = (t // n_blocks1) * (H // KS1)
                acc = _gemv_tile(xn_row, wqkv_ptr, offs_n, offs_n < NQKV, offs_m, k_lo,
                                 k_lo + H // KS1, H, H, 1, BN1, BK, PREC)  # fmt: skip
                tl.store(qkv_part_ptr + (t // n_blocks1) * NQKV + offs_n, tl.sum(acc, 0))
    if PHASE == 0:
        # o_proj's first tiles of this program, read now: they stream from HBM while the
        # grid waits for the projection and then attends.
        if AHEAD >= 1:
            w_a = _load_o_tile(wo_ptr, pid, H, NQD, BN3, BK3)
        if AHEAD >= 2:
            w_b = _load_o_tile(wo_ptr, pid + n_programs, H, NQD, BN3, BK3)
        if AHEAD >= 3:
            w_c = _load_o_tile(wo_ptr, pid + 2 * n_programs, H, NQD, BN3, BK3)
        if AHEAD >= 4:
            w_d = _load_o_tile(wo_ptr, pid + 3 * n_programs, H, NQD, BN3, BK3)
        if L2 & 2:  # the rest of this program's o_proj rows, asked of L2 before the waits
            for t in range(pid + AHEAD * n_programs, (H // BN3) * KS3, n_programs):
                offs_n3 = (t % (H // BN3)) * BN3 + tl.arange(0, BN3)
                k3 = (t // (H // BN3)) * BK3
                _prefetch_tile(wo_ptr, offs_n3, offs_n3 < H, k3, k3 + BK3, NQD, 4)
        _arrive(count_ptr)
        _wait_for(count_ptr, n_programs)

    if PHASE == 0 or PHASE == 2:  # noqa: SIM102 - a compile-time branch around a run-time one
        if pid < NKV * NS:  # q/k norms, RoPE, the K/V store, attention, the combine
            g = pid // NS
            j = pid % NS
            pos = tl.load(pos_ptr)
            offs_d, d_ok, in_rot, first_half, partner = _rotary_dims(D, D, D)
            rows = tl.arange(0, 16)
            q_ok = (rows < G)[:, None] & d_ok[None, :]  # [16, D]
            q_at = (g * G + rows)[:, None] * D
            qx = _sum_slices(qkv_part_ptr, q_at + offs_d[None, :], q_ok, NQKV, KS1, MODE)
            qxp = _sum_slices(qkv_part_ptr, q_at + partner[None, :], q_ok, NQKV, KS1, MODE)
            cos_row = cos_ptr + pos * stride_cos
            sin_row = sin_ptr + pos * stride_cos
            q = _norm_rope_values(qx, qxp, qn_ptr, cos_row, sin_row, offs_d, d_ok, in_rot,
                                  first_half, partner, qk_eps, inv_d, True, MODE)  # fmt: skip
            q = tl.where(q_ok, q, 0.0)  # [16, D] fp32, rows G..15 zero
            k_at = NQD + g * D
            kx = _sum_slices(qkv_part_ptr, k_at + offs_d[None, :], d_ok[None, :], NQKV, KS1,
                             MODE)  # fmt: skip
            kxp = _sum_slices(qkv_part_ptr, k_at + partner[None, :], d_ok[None, :], NQKV, KS1,
                              MODE)  # fmt: skip
            k_new = _norm_rope_values(kx, kxp, kn_ptr, cos_row, sin_row, offs_d, d_ok, in_rot,
                                      first_half, partner, qk_eps, inv_d, True, MODE)  # fmt: skip
            v_new = _sum_slices(qkv_part_ptr, k_at + NKV * D + offs_d[None, :], d_ok[None, :],
                                NQKV, KS1, MODE)  # [1, D]  # fmt: skip
            kv_at = (pos * NKV + g) * D + offs_d[None, :]
            if j == 0:
                tl.store(k_cache_ptr + kv_at, k_new.to(k_cache_ptr.dtype.element_ty))
                tl.store(v_cache_ptr + kv_at, v_new.to(v_cache_ptr.dtype.element_ty))
            q_in = q.to(k_cache_ptr.dtype.element_ty)
            acc = tl.zeros([16, D], tl.float32)
            l_i = tl.zeros([16], tl.float32)
            m_i = tl.full([16], -1.0e30, tl.float32)
            per = (pos + NS - 1) // NS
            lo = j * per
            hi = tl.minimum(lo + per, pos)
            for t0 in range(lo, hi, BL):  # the cached positions of this split
                offs_t = t0 + tl.arange(0, BL)
                t_ok = offs_t < hi
                at = (offs_t.to(tl.int64)[:, None] * NKV + g) * D + offs_d[None, :]
                kt = tl.load(k_cache_ptr + at, mask=t_ok[:, None], other=0.0)  # [BL, D]
                sc = tl.dot(q_in, tl.trans(kt), input_precision=PREC) * scale  # [16, BL]
                sc = tl.where(t_ok[None, :], sc, -1.0e30)
                m_new = tl.maximum(m_i, tl.max(sc, 1))
                alpha = tl.exp(m_i - m_new)
                p = tl.exp(sc - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                vt = tl.load(v_cache_ptr + at, mask=t_ok[:, None], other=0.0)  # [BL, D]
                acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PREC)
                m_i = m_new
            if j == NS - 1:  # the new token, from registers
                k_r = k_new.to(k_cache_ptr.dtype.element_ty).to(tl.float32)  # as stored
                v_r = v_new.to(v_cache_ptr.dtype.element_ty).to(tl.float32)
                sn = tl.sum(q_in.to(tl.float32) * k_r, 1) * scale  # [16]
                m_new = tl.maximum(m_i, sn)
                alpha = tl.exp(m_i - m_new)
                pn = tl.exp(sn - m_new)
                l_i = l_i * alpha + pn
                acc = acc * alpha[:, None] + pn[:, None] * v_r
                m_i = m_new
            split = g * NS + j
            tl.store(att_acc_ptr + (split * 16 + rows)[:, None] * D + offs_d[None, :], acc)
            tl.store(att_ml_ptr + split * 32 + rows, m_i)
            tl.store(att_ml_ptr + split * 32 + 16 + rows, l_i)
            tl.debug_barrier()
            if tl.atomic_add(count_ptr + COUNT_HEADS + g, 1, sem="acq_rel", scope="gpu") == NS - 1:
                tl.store(count_ptr + COUNT_HEADS + g, 0)
                m_all = tl.full([16], -1.0e30, tl.float32)
                for jj in range(NS):
                    m_j = tl.load(att_ml_ptr + (g * NS + jj) * 32 + rows, cache_modifier=".cg")
                    m_all = tl.maximum(m_all, m_j)
                num = tl.zeros([16, D], tl.float32)
                den = tl.zeros([16], tl.float32)
                for jj in range(NS):
                    at_j = (g * NS + jj) * 32
                    wj = tl.exp(tl.load(att_ml_ptr + at_j + rows, cache_modifier=".cg") - m_all)
                    den += wj * tl.load(att_ml_ptr + at_j + 16 + rows, cache_modifier=".cg")
                    a_j = tl.load(att_acc_ptr + ((g * NS + jj) * 16 + rows)[:, None] * D
                                  + offs_d[None, :], cache_modifier=".cg")  # fmt: skip
                    num += wj[:, None] * a_j
                out = num / den[:, None]
                tl.store(attn_ptr + q_at + offs_d[None, :],
                         out.to(attn_ptr.dtype.element_ty), mask=q_ok)  # fmt: skip
                if PHASE == 0:
                    _arrive(count_ptr + 1)

    if PHASE == 0 or PHASE == 3:  # o_proj, the residual add, the post-attention norm
        tile = pid
        if PHASE == 0:
            _wait_for(count_ptr + 1, NKV)
            if AHEAD >= 1:
                _o_tile(w_a, tile, attn_ptr, o_part_ptr, offs_m, H, NQD, BN3, BK3, PREC)
                tile += n_programs
            if AHEAD >= 2:
                _o_tile(w_b, tile, attn_ptr, o_part_ptr, offs_m, H, NQD, BN3, BK3, PREC)
                tile += n_programs
            if AHEAD >= 3:
                _o_tile(w_c, tile, attn_ptr, o_part_ptr, offs_m, H, NQD, BN3, BK3, PREC)
                tile += n_programs
            if AHEAD >= 4:
                _o_tile(w_d, tile, attn_ptr, o_part_ptr, offs_m, H, NQD, BN3, BK3, PREC)
                tile += n_programs
        if STREAM:
            _stream_tiles(attn_ptr, wo_ptr, o_part_ptr, tile, n_programs, offs_m, H, NQD, BN3,
                          KS3, BK, PREC)  # fmt: skip
        else:
            for t in range(tile, (H // BN3) * KS3, n_programs):
                w = _load_o_tile(wo_ptr, t, H, NQD, BN3, BK3)
                _o_tile(w, t, attn_ptr, o_part_ptr, offs_m, H, NQD, BN3, BK3, PREC)
        tl.debug_barrier()
        if tl.atomic_add(count_ptr + 2, 1, sem="acq_rel", scope="gpu") == n_programs - 1:
            tl.store(count_ptr, 0)  # every program is past every wait: the counters reset
            tl.store(count_ptr + 1, 0)
            tl.store(count_ptr + 2, 0)
            y = tl.zeros([ROW], tl.float32)
            for ks in tl.static_range(KS3):  # slice order: the same sum every launch
                y += tl.load(o_part_ptr + ks * H + offs, mask=row_ok, other=0.0,
                             cache_modifier=".cg")  # fmt: skip
            res = tl.load(s_ptr + offs, mask=row_ok, other=0.0, cache_modifier=".cg")
            row = round_to(round_to(y, MODE) + res.to(tl.float32), MODE)
            _normalise_row(row, offs, row_ok, w_post_ptr, h_ptr, s_ptr, inv_h, eps, True, MODE,
                           False)  # fmt: skip


def split_tiles(h: int, nqkv: int, nqd: int, bn1: int, ks1: int, bk: int, bn3: int, ks3: int):
    """Checks that the tiles cover the shapes exactly (the kernel does not mask partial ones)."""
    assert nqkv % bn1 == 0 and h % ks1 == 0 and (h // ks1) % bk == 0, (nqkv, bn1, h, ks1, bk)
    assert h % bn3 == 0 and nqd % ks3 == 0, (h, bn3, nqd, ks3)
    assert triton.next_power_of_2(nqd // ks3) == nqd // ks3, "o_proj's slice is one load"
    assert (nqd // ks3) % bk == 0, "o_proj's slice in whole steps (STREAM)"
