"""A one-token decode step's attention block in ONE persistent launch: the input RMSNorm (with
the residual add), the q/k/v projection, the per-head q/k norms, RoPE and the K/V store,
attention over the paged cache, o_proj, the residual add and the post-attention RMSNorm
(kernels/attention_block.py dispatches; EngineConfig.attention_block).

Why: at b=1 the decoder runs these as five launches (the norm kernel, cuBLAS's qkv GEMV, the
rope kernel, paged attention, o_proj + norm), ~32-34 us a layer at the Qwen3-30B-A3B shape on
the H200 for ~38 MB of weights. The probe of one grid of one program per SM, its phases
separated by grid-wide counters, took 28.6 / 30.0 us at 256 / 1024 cached tokens with a
contiguous cache (`bench attention-half`, thirty-ninth session: -10% / -13%), this kernel
30.4 / 32.3; reading o_proj ahead (into registers or L2) lost there, and so is not done here.
In the 48-layer step it lost 3.7% at b=1 before it was PDL-aware (NOTES): EngineConfig.
attention_block is off.

The grid: P = the SM count, so every program is resident at once and a program spinning at a
counter never keeps another from running (the waits cannot deadlock; a kernel sharing the
SMs on another stream only delays them). Phases:
  1. every program normalises the row itself (s = round(x + r); a 4 KB read, no wait), keeps
     its copy in `xn` (a row of [P, H]) and computes its qkv tiles (BN1 rows x one of KS1
     slices of H) as fp32 partials [KS1, NQKV], all of its tiles one pipelined loop
     (`_stream_tiles`: Triton's persistent-matmul flattening, so loads stay in flight across
     tile boundaries). Then it arrives at counter 0 and waits for all P.
  2. program (g, j), g < NKV, j < NS: sums its kv head's q rows and k, v (slice order, rounded
     to the model dtype), applies the q/k norms and RoPE (the rope kernel's
     `_norm_rope_values`), stores k and v at the new token's slot (j = 0) and attends over
     its split of the cached positions through the page table; the last used split adds the
     new token from registers (no program reads the slot being written). Splits hold at least
     MIN_SPLIT positions, so a short context uses few. The last used split of a kv head to
     finish (acquire-release counter) combines the partials into the attention output and
     arrives at counter 1.
  3. every program waits for counter 1 to reach NKV, computes its o_proj tiles as partials
     [KS3, H] (one loop again); the last program to finish sums them in slice order, rounds,
     adds the residual (rounded), runs the norm kernel's row code, and puts the counters back.
PHASE 0 runs all three with the waits; PHASE 1, 2, 3 run one each as three launches (the
interpreter's tests: its programs run one after another, so a wait cannot run there).

Numerics: the engine's rounding points (the norm's, the projection's output, q/k after their
norms and RoPE, the stored K/V, the o_proj output, the residual add); the sums run in other
orders than cuBLAS's and the attention kernel's, so a value can land an ulp of the model dtype
away from the five launches'.

Shape legend: H hidden, D head dim, NQ / NKV query / kv heads (G = NQ / NKV <= 16 per kv head),
NQKV = (NQ + 2 NKV) D, NQD = NQ D, NS splits per kv head at most, P programs, S page size.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from freetoken_agent.kernels.attention_block import COUNT_WORDS, MIN_SPLIT, splits_for
from freetoken_agent.kernels.triton.norm import (
    _load_sum,
    _normalise_row,
    _row_rstd,
    _scale,
    round_mode,
    round_to,
)
from freetoken_agent.kernels.triton.pdl import enter
from freetoken_agent.kernels.triton.pdl import launch as pdl_launch
from freetoken_agent.kernels.triton.rope import _norm_rope_values, _rotary_dims
from freetoken_agent.kernels.triton.split_combine import COMBINE_CHUNK, _combine_rows

# count's words (COUNT_WORDS + NKV): [0] phase-1 arrivals, [1] kv heads combined, [2] phase-3
# arrivals, [COUNT_WORDS + g] kv head g's finished splits.
_COUNT_HEADS = tl.constexpr(COUNT_WORDS)


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
def _stream_tiles(x_ptr, w_ptr, part_ptr, first, step, offs_m,
                  N: tl.constexpr, K: tl.constexpr, BN: tl.constexpr, KS: tl.constexpr,
                  BK: tl.constexpr, PREC: tl.constexpr):  # fmt: skip
    """Tiles first, first + step, ... of an [N, K] weight (BN rows x one of KS slices of K
    each) as ONE loop of BK-wide steps, so the loads stay in flight across tile boundaries
    where a loop per tile drains at each: each tile's fp32 partial of x . W rows over its
    slice lands in part [KS, N]. x: a row [K] (written by other programs: read past L1)."""
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
def _attention_block_kernel(
    x_ptr, r_ptr,  # [H] the layer's input and the residual stream (r unused without HAS_RES)
    w_in_ptr, w_post_ptr,  # [H] the input and post-attention norms' weights
    wqkv_ptr,  # [NQKV, H]
    wo_ptr,  # [H, NQD]
    qn_ptr, kn_ptr,  # [D] the per-head q and k norms' weights (unused without QK_NORM)
    cos_ptr, sin_ptr,  # [max_pos, ROT] RoPE tables
    pos_ptr,  # [1] int64: the new token's position (RoPE)
    kv_len_ptr,  # [1] int32: the sequence's KV length with the new token
    slot_ptr,  # [1] int64: the new token's cache slot (page * S + offset)
    page_table_ptr,  # [max_pages] int32: the sequence's pages
    k_cache_ptr, v_cache_ptr,  # [pages, S, NKV, D]
    xn_ptr,  # [P, H] each program's normalised row
    qkv_part_ptr,  # [KS1, NQKV] fp32
    att_acc_ptr, att_ml_ptr,  # [NQ, NS, D], [2, NQ, NS] fp32: split partials, their m and l
    attn_ptr,  # [NQD] the attention output (model dtype)
    o_part_ptr,  # [KS3, H] fp32
    h_ptr, s_ptr,  # [H] out: the normalised row, the residual stream
    count_ptr,  # [COUNT_WORDS + NKV] int32, 0 between launches
    eps, qk_eps, inv_h, inv_d, scale, stride_cos, stride_kp, stride_ks,
    H: tl.constexpr, ROW: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr, NQ: tl.constexpr,
    NKV: tl.constexpr, S: tl.constexpr, BN1: tl.constexpr, KS1: tl.constexpr,
    BK: tl.constexpr, NS: tl.constexpr, SPLIT_MIN: tl.constexpr, BL: tl.constexpr,
    BN3: tl.constexpr, KS3: tl.constexpr, HAS_RES: tl.constexpr, QK_NORM: tl.constexpr,
    SPLITS_PAD: tl.constexpr, CHUNK: tl.constexpr, PHASE: tl.constexpr, MODE: tl.constexpr,
    PREC: tl.constexpr,
    PDL: tl.constexpr = 0,
):  # fmt: skip
    # First: pdl.py. Its release lets the next kernel launch only once every program of this
    # grid has started, so an early-launched dependent never keeps one of ours off the SMs
    # (the waits below need all of them resident).
    enter(PDL)
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    offs_m = tl.arange(0, 16)
    NQKV: tl.constexpr = (NQ + 2 * NKV) * D
    NQD: tl.constexpr = NQ * D
    offs = tl.arange(0, ROW)
    row_ok = offs < H

    if PHASE == 0 or PHASE == 1:  # the input norm and the q/k/v projection
        s = _load_sum(x_ptr, r_ptr, offs, row_ok, HAS_RES, MODE)  # round(x + r), or x
        xn = _scale(s, _row_rstd(s, inv_h, eps), w_in_ptr, offs, row_ok, False, MODE)
        xn_row = xn_ptr + pid * H
        tl.store(xn_row + offs, xn.to(xn_ptr.dtype.element_ty), mask=row_ok)
        if pid == 0:
            tl.store(s_ptr + offs, s.to(s_ptr.dtype.element_ty), mask=row_ok)
        tl.debug_barrier()  # the row's stores before any thread's loads of it
        _stream_tiles(xn_row, wqkv_ptr, qkv_part_ptr, pid, n_programs, offs_m, NQKV, H, BN1,
                      KS1, BK, PREC)  # fmt: skip
    if PHASE == 0:
        _arrive(count_ptr)
        _wait_for(count_ptr, n_programs)

    if PHASE == 0 or PHASE == 2:  # noqa: SIM102 - a compile-time branch around a run-time one
        if pid < NKV * NS:  # q/k norms, RoPE, the K/V store, attention, the combine
            g = pid // NS
            j = pid % NS
            cached = tl.load(kv_len_ptr) - 1  # positions before the new token
            per = tl.maximum((cached + NS - 1) // NS, SPLIT_MIN)
            used = tl.maximum((cached + per - 1) // per, 1)  # splits holding a position
            if j < used:
                _attend_split(qkv_part_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr,
                              page_table_ptr, k_cache_ptr, v_cache_ptr, att_acc_ptr, att_ml_ptr,
                              attn_ptr, count_ptr, g, j, used, cached, per, qk_eps, inv_d,
                              scale, stride_cos, stride_kp, stride_ks, D, ROT, NQ, NKV, S, KS1,
                              NS, SPLITS_PAD, CHUNK, BL, QK_NORM, PHASE, MODE,
                              PREC)  # fmt: skip

    if PHASE == 0 or PHASE == 3:  # o_proj, the residual add, the post-attention norm
        if PHASE == 0:
            _wait_for(count_ptr + 1, NKV)
        _stream_tiles(attn_ptr, wo_ptr, o_part_ptr, pid, n_programs, offs_m, H, NQD, BN3, KS3,
                      BK, PREC)  # fmt: skip
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


@triton.jit
def _attend_split(
    qkv_part_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, page_table_ptr,
    k_cache_ptr, v_cache_ptr, att_acc_ptr, att_ml_ptr, attn_ptr, count_ptr, g, j, used, cached,
    per, qk_eps, inv_d, scale, stride_cos, stride_kp, stride_ks,
    D: tl.constexpr, ROT: tl.constexpr, NQ: tl.constexpr, NKV: tl.constexpr, S: tl.constexpr,
    KS1: tl.constexpr, NS: tl.constexpr, SPLITS_PAD: tl.constexpr, CHUNK: tl.constexpr,
    BL: tl.constexpr, QK_NORM: tl.constexpr, PHASE: tl.constexpr, MODE: tl.constexpr,
    PREC: tl.constexpr,
):  # fmt: skip
    """Split j of kv head g: its q heads and the new k, v (normed, rotated, rounded), attention
    over positions [j per, min((j + 1) per, cached)) (plus the new token in the last used
    split) as partials in the paged attention kernel's layout (scores in the log2 domain);
    the last split of the head to finish combines them with its `_combine_rows`."""
    NQKV: tl.constexpr = (NQ + 2 * NKV) * D
    NQD: tl.constexpr = NQ * D
    G: tl.constexpr = NQ // NKV
    offs_d, d_ok, in_rot, first_half, partner = _rotary_dims(D, D, ROT)
    rows = tl.arange(0, 16)
    q_ok = (rows < G)[:, None] & d_ok[None, :]  # [16, D]
    q_at = (g * G + rows)[:, None] * D
    pos = tl.load(pos_ptr)
    cos_row = cos_ptr + pos * stride_cos
    sin_row = sin_ptr + pos * stride_cos
    qx = _sum_slices(qkv_part_ptr, q_at + offs_d[None, :], q_ok, NQKV, KS1, MODE)
    qxp = _sum_slices(qkv_part_ptr, q_at + partner[None, :], q_ok, NQKV, KS1, MODE)
    q = _norm_rope_values(qx, qxp, qn_ptr, cos_row, sin_row, offs_d, d_ok, in_rot, first_half,
                          partner, qk_eps, inv_d, QK_NORM, MODE)  # fmt: skip
    q = tl.where(q_ok, q, 0.0)  # [16, D] fp32, rows G..15 zero
    k_at = NQD + g * D
    kx = _sum_slices(qkv_part_ptr, k_at + offs_d[None, :], d_ok[None, :], NQKV, KS1, MODE)
    kxp = _sum_slices(qkv_part_ptr, k_at + partner[None, :], d_ok[None, :], NQKV, KS1, MODE)
    k_new = _norm_rope_values(kx, kxp, kn_ptr, cos_row, sin_row, offs_d, d_ok, in_rot,
                              first_half, partner, qk_eps, inv_d, QK_NORM, MODE)  # fmt: skip
    v_new = _sum_slices(qkv_part_ptr, k_at + NKV * D + offs_d[None, :], d_ok[None, :], NQKV, KS1,
                        MODE)  # [1, D]  # fmt: skip
    if j == 0:
        slot = tl.load(slot_ptr)
        at = (slot // S) * stride_kp + (slot % S) * stride_ks + g * D + offs_d[None, :]
        tl.store(k_cache_ptr + at, k_new.to(k_cache_ptr.dtype.element_ty))
        tl.store(v_cache_ptr + at, v_new.to(v_cache_ptr.dtype.element_ty))
    q_in = q.to(k_cache_ptr.dtype.element_ty)
    qk_scale = scale * 1.4426950408889634  # log2(e): exp2 below, as the combine takes them
    acc = tl.zeros([16, D], tl.float32)
    l_i = tl.zeros([16], tl.float32)
    m_i = tl.full([16], -1.0e30, tl.float32)
    lo = j * per
    hi = tl.minimum(lo + per, cached)
    for t0 in range(lo, hi, BL):  # this split's cached positions, through the page table
        offs_t = t0 + tl.arange(0, BL)
        t_ok = offs_t < hi
        page = tl.load(page_table_ptr + offs_t // S, mask=t_ok, other=0).to(tl.int64)
        at = (page * stride_kp + (offs_t % S) * stride_ks + g * D)[:, None] + offs_d[None, :]
        kt = tl.load(k_cache_ptr + at, mask=t_ok[:, None], other=0.0)  # [BL, D]
        sc = tl.dot(q_in, tl.trans(kt), input_precision=PREC) * qk_scale  # [16, BL]
        sc = tl.where(t_ok[None, :], sc, -1.0e30)
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(sc - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        vt = tl.load(v_cache_ptr + at, mask=t_ok[:, None], other=0.0)  # [BL, D]
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PREC)
        m_i = m_new
    if j == used - 1:  # the new token, from registers, as stored
        k_r = k_new.to(k_cache_ptr.dtype.element_ty).to(tl.float32)
        v_r = v_new.to(v_cache_ptr.dtype.element_ty).to(tl.float32)
        sn = tl.sum(q_in.to(tl.float32) * k_r, 1) * qk_scale  # [16]
        m_new = tl.maximum(m_i, sn)
        alpha = tl.exp2(m_i - m_new)
        pn = tl.exp2(sn - m_new)
        l_i = l_i * alpha + pn
        acc = acc * alpha[:, None] + pn[:, None] * v_r
        m_i = m_new
    row_ok = rows < G
    part = (g * G + rows) * NS  # [16] each head's first partial (padding rows: never stored)
    tl.store(att_acc_ptr + (part + j)[:, None] * D + offs_d[None, :], acc, mask=q_ok)
    tl.store(att_ml_ptr + part + j, m_i, mask=row_ok)
    tl.store(att_ml_ptr + NQ * NS + part + j, l_i, mask=row_ok)
    tl.debug_barrier()
    if tl.atomic_add(count_ptr + _COUNT_HEADS + g, 1, sem="acq_rel", scope="gpu") == used - 1:
        tl.store(count_ptr + _COUNT_HEADS + g, 0)
        _combine_rows(att_acc_ptr, att_ml_ptr, att_ml_ptr + NQ * NS, part, row_ok, used,
                      attn_ptr + q_at + offs_d[None, :], q_ok, 16, D, D, SPLITS_PAD,
                      CHUNK)  # fmt: skip
        if PHASE == 0:
            _arrive(count_ptr + 1)


def new_scratch(h: int, heads: int, kv_heads: int, head_dim: int, programs: int,
                tiles: dict[str, int], dtype: torch.dtype,
                device: torch.device | str) -> tuple[Tensor, ...]:  # fmt: skip
    """A layer's buffers for `programs` programs (its own: full size at once, so a captured
    graph keeps their addresses): xn [P, H], qkv partials [KS1, NQKV], attention partials
    [NQ, NS, D] with their m and l [2, NQ, NS], the attention output [NQD], o_proj partials
    [KS3, H] (fp32 but xn and the output) and the counters [COUNT_WORDS + NKV] (int32, 0)."""
    ns = splits_for(kv_heads, programs)
    f32 = dict(dtype=torch.float32, device=device)
    return (
        torch.empty(programs, h, dtype=dtype, device=device),
        torch.empty(tiles["KS1"], (heads + 2 * kv_heads) * head_dim, **f32),
        torch.empty(heads, ns, head_dim, **f32),
        torch.empty(2, heads, ns, **f32),
        torch.empty(heads * head_dim, dtype=dtype, device=device),
        torch.empty(tiles["KS3"], h, **f32),
        torch.zeros(COUNT_WORDS + kv_heads, dtype=torch.int32, device=device),
    )


def attention_block(
    x: Tensor,
    residual: Tensor | None,
    in_norm: Tensor,
    eps: float,
    w_qkv: Tensor,
    q_norm: Tensor | None,
    k_norm: Tensor | None,
    qk_eps: float,
    cos: Tensor,
    sin: Tensor,
    positions: Tensor,
    kv_lens: Tensor,
    slot_mapping: Tensor,
    page_table: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    w_o: Tensor,
    post_norm: Tensor,
    heads: int,
    scale: float,
    scratch: tuple[Tensor, ...],
    tiles: dict[str, int],
    *,
    persistent: bool = True,
    min_split: int = MIN_SPLIT,
) -> tuple[Tensor, Tensor]:
    """kernels/attention_block.py's contract for one token (x [1, H]); `scratch`:
    new_scratch's, its first dim the programs (the SM count for `persistent`); `tiles`:
    block_tiles'. persistent False: the three phases as launches (the interpreter's way).
    `min_split`: positions a split takes at least (tests take short contexts apart)."""
    xn, qkv_part, att_acc, att_ml, attn, o_part, count = scratch
    programs, hid = xn.shape
    kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    ns = att_acc.shape[1]
    assert x.shape == (1, hid) and kv_heads * ns <= programs, (tuple(x.shape), kv_heads, ns)
    assert k_cache.stride()[2:] == (head_dim, 1) and k_cache.stride() == v_cache.stride()
    h, s = torch.empty_like(x), torch.empty_like(x)
    args = (x, residual if residual is not None else x, in_norm, post_norm, w_qkv, w_o,
            q_norm if q_norm is not None else in_norm, k_norm if k_norm is not None else in_norm,
            cos, sin, positions, kv_lens, slot_mapping, page_table, k_cache, v_cache, xn,
            qkv_part, att_acc, att_ml, attn, o_part, h, s, count, eps, qk_eps, 1.0 / hid,
            1.0 / head_dim, scale, cos.stride(0), k_cache.stride(0), k_cache.stride(1))  # fmt: skip
    consts = dict(H=hid, ROW=triton.next_power_of_2(hid), D=head_dim, ROT=cos.shape[1],
                  NQ=heads, NKV=kv_heads, S=k_cache.shape[1], NS=ns, SPLIT_MIN=min_split,
                  SPLITS_PAD=triton.next_power_of_2(ns), CHUNK=COMBINE_CHUNK,
                  BN1=tiles["BN1"], KS1=tiles["KS1"], BK=tiles["BK"], BL=tiles["BL"],
                  BN3=tiles["BN3"], KS3=tiles["KS3"], HAS_RES=residual is not None,
                  QK_NORM=q_norm is not None, MODE=round_mode(x.dtype),
                  PREC="ieee" if x.dtype == torch.float32 else "tf32",
                  num_warps=tiles["WARPS"])  # fmt: skip
    if persistent:  # launched early under PDL `light` too: it always follows the MoE sum
        _attention_block_kernel[(programs,)](
            *args, PHASE=0, **consts, **pdl_launch(x.device, heavy=True, lead=True)
        )
    else:
        for phase in (1, 2, 3):
            grid = kv_heads * ns if phase == 2 else programs
            _attention_block_kernel[(grid,)](*args, PHASE=phase, **consts)
    return h, s
