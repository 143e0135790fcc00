"""Decode path of the Triton fused MoE: grouped-by-row kernels for few (token, choice) pairs.

Pairs that picked the same row form a group whose leader computes it all, so no sort is needed;
see `fused_moe.py`'s docstring for the overview of both paths, the shape legend and determinism.
"""

import torch
import triton
import triton.language as tl

from freetoken_agent.kernels.reference import check_add, check_slot_cols
from freetoken_agent.kernels.reference_fills import CpuAnswer
from freetoken_agent.kernels.triton.cpu_answer import sys_ordering, timeout_ticks
from freetoken_agent.kernels.triton.gemv import _prefetch_tile
from freetoken_agent.kernels.triton.moe_common import (
    DECODE_MAX_PAIRS,
    DECODE_TILES,
    _check,
    _check_host,
    _dot_precision,
    _sum_over_k_kernel,
    _tiles,
)
from freetoken_agent.kernels.triton.pdl import enter
from freetoken_agent.kernels.triton.pdl import launch as pdl_launch


@triton.jit
def _group(ids_ptr, p, P, BLOCK_P: tl.constexpr):
    """Row of pair p, how many earlier pairs picked it (0: p leads), member mask and ranks."""
    row = tl.load(ids_ptr + p)
    offs_p = tl.arange(0, BLOCK_P)
    ids = tl.load(ids_ptr + offs_p, mask=offs_p < P, other=-1)  # [BLOCK_P]
    same = ids == row
    n_before = tl.sum((same & (offs_p < p)).to(tl.int32), axis=0)
    rank = tl.cumsum(same.to(tl.int32), axis=0) - 1  # [BLOCK_P] member index within the group
    return row, n_before, same, rank, tl.sum(same.to(tl.int32), axis=0)


@triton.jit
def _members(same, rank, m0, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr):
    """Pairs of members m0 .. m0 + BLOCK_M - 1, compacted into tile rows: [BLOCK_M]."""
    offs_p = tl.arange(0, BLOCK_P)
    sel = same[None, :] & (rank[None, :] == (m0 + tl.arange(0, BLOCK_M))[:, None])
    return tl.sum(tl.where(sel, offs_p[None, :], 0), axis=1)  # [BLOCK_M, BLOCK_P] -> [BLOCK_M]


@triton.jit
def _skipped(row, HOST: tl.constexpr):
    """Whether a pair's id means skip: any negative id, or with host banks only -1 (ids <= -2
    name host rows)."""
    if HOST:
        return row == -1
    return row < 0


@triton.jit
def _row_ptr(bank_ptr, stride, host_ptr, host_stride, row, HOST: tl.constexpr):
    """Start of the weights of a pair's row: bank row `row`, or with HOST and row <= -2 host
    row -row - 2 (pinned host memory, read by the kernel itself over the link)."""
    ptr = bank_ptr + row.to(tl.int64) * stride
    if HOST:  # noqa: SIM102 - a compile-time branch around a run-time one (Triton)
        if row < -1:
            ptr = host_ptr + (-row - 2).to(tl.int64) * host_stride
    return ptr


@triton.jit
def _fill_row(bank_ptr, stride, slot_of_ptr, row):
    """Fill-through: the slot row a host row's tiles are also stored into (the fill plan gave
    its lid that slot, `slot_of`), and whether there is one (a miss left without a slot is
    only read)."""
    lid = tl.maximum(-row - 2, 0).to(tl.int64)
    slot = tl.load(slot_of_ptr + lid)
    return bank_ptr + tl.maximum(slot, 0).to(tl.int64) * stride, (row < -1) & (slot >= 0)


@triton.jit
def _row_cols(cols_ptr, row, I):  # noqa: E741
    """The columns [0, c) of I a pair's row holds: its bank row's c, I for a host row (whole
    in the pool, id <= -2)."""
    return tl.load(cols_ptr + tl.maximum(row, 0), mask=row >= 0, other=I)


@triton.jit
def _prefetch_rows(ids_ptr, p, i0, w13_ptr, stride13, H, I, BLOCK_I: tl.constexpr,  # noqa: E741
                   PDL: tl.constexpr):  # fmt: skip
    """With PREFETCH (launched so only where the rows are the fill plan's, two kernels back:
    pdl.py), the L2 prefetch of the gate and up lines of pair p's slot row for outputs
    i0 .. i0 + BLOCK_I - 1 (the skinny matmul's `_prefetch_tile` over each [BLOCK_I, H] tile).
    A host row or a skip: nothing."""
    if PDL & 4:  # PREFETCH
        row = tl.load(ids_ptr + p, cache_modifier=".cg")  # past L1: another kernel wrote it
        if row >= 0:
            offs_i = i0 + tl.arange(0, BLOCK_I)
            gate = w13_ptr + row.to(tl.int64) * stride13  # [2I, H]: gate rows, then up rows
            _prefetch_tile(gate, offs_i, offs_i < I, 0, H, H, PDL)
            _prefetch_tile(gate + I * H, offs_i, offs_i < I, 0, H, H, PDL)


@triton.jit
def _decode_gate_up_kernel(
    x_ptr,  # [T, H]
    w13_ptr,  # [N, 2I, H]
    ids_ptr,  # [P]
    hi_ptr,  # [P, I] act, or with SPLIT its high 16-bit part
    lo_ptr,  # [P, I] with SPLIT: act - hi, rounded to 16 bits
    stride13,  # elements between w13 rows (2I*H dense; larger for arena slots)
    hw13_ptr,  # [Nh, 2I, H] host bank (HOST), read over the link; else any bank
    hstride13,
    slot_of_ptr,  # [Nh] int32 (FILL): the slot each host row's lid was given, or -1
    cols_ptr,  # [N] int32 (PARTIAL): the columns [0, c) of I each bank row holds
    P,
    H,
    I,  # noqa: E741 (the shape legend's name)
    K: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_I: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PREC: tl.constexpr,
    SPLIT: tl.constexpr,
    HOST: tl.constexpr,
    FILL: tl.constexpr,
    PARTIAL: tl.constexpr,
    PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    n_iblk = tl.cdiv(I, BLOCK_I)
    _prefetch_rows(ids_ptr, pid // n_iblk, (pid % n_iblk) * BLOCK_I, w13_ptr, stride13, H, I,
                   BLOCK_I, PDL)  # fmt: skip
    enter(PDL)  # after the prefetch of settled rows, before anything else: pdl.py
    row, n_before, same, rank, n_group = _group(ids_ptr, pid // n_iblk, P, BLOCK_P)
    if _skipped(row, HOST):
        return
    if n_before > 0:
        return
    offs_m = tl.arange(0, BLOCK_M)
    offs_i = (pid % n_iblk) * BLOCK_I + tl.arange(0, BLOCK_I)
    offs_h = tl.arange(0, BLOCK_H)
    i_mask = offs_i < I
    if PARTIAL:  # a bank row holding columns [0, c) only: the block's part below c
        cols = _row_cols(cols_ptr, row, I)
        if (pid % n_iblk) * BLOCK_I >= cols:
            return  # its act entries stay unwritten: down reads none past c
        i_mask = offs_i < cols
    # [BLOCK_H, BLOCK_I] tiles of the gate rows; the up rows sit I * H elements further.
    w_row = _row_ptr(w13_ptr, stride13, hw13_ptr, hstride13, row, HOST)
    w_ptrs = w_row + offs_i[None, :] * H + offs_h[:, None]
    if FILL:  # a host row's tiles also go into its new slot, as they are read
        f_row, f_ok = _fill_row(w13_ptr, stride13, slot_of_ptr, row)
        f_ptrs = f_row + offs_i[None, :] * H + offs_h[:, None]
    for m0 in range(0, n_group, BLOCK_M):  # more than BLOCK_M members: rare, re-reads from L2
        pair = _members(same, rank, m0, BLOCK_M, BLOCK_P)
        valid = (m0 + offs_m) < n_group
        x_ptrs = x_ptr + (pair // K)[:, None] * H + offs_h[None, :]  # [BLOCK_M, BLOCK_H]
        acc_g = tl.zeros((BLOCK_M, BLOCK_I), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_I), dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            h_mask = (h0 + offs_h) < H
            x = tl.load(x_ptrs + h0, mask=valid[:, None] & h_mask[None, :], other=0.0)
            w_mask = h_mask[:, None] & i_mask[None, :]
            wg = tl.load(w_ptrs + h0, mask=w_mask, other=0.0)
            wu = tl.load(w_ptrs + I * H + h0, mask=w_mask, other=0.0)
            if FILL:  # noqa: SIM102 - a compile-time branch around a run-time one (Triton)
                if f_ok:
                    tl.store(f_ptrs + h0, wg, mask=w_mask)
                    tl.store(f_ptrs + I * H + h0, wu, mask=w_mask)
            acc_g = tl.dot(x, wg, acc_g, input_precision=PREC)
            acc_u = tl.dot(x, wu, acc_u, input_precision=PREC)
        act = acc_g * tl.sigmoid(acc_g) * acc_u  # SwiGLU in fp32
        a_off = pair[:, None] * I + offs_i[None, :]
        a_mask = valid[:, None] & i_mask[None, :]
        hi = act.to(hi_ptr.dtype.element_ty)
        tl.store(hi_ptr + a_off, hi, mask=a_mask)
        if SPLIT:
            # The down GEMM's tensor cores take 16-bit operands: keep the fp32 act as a high and
            # a low 16-bit part (16 significant bits together) rather than round it to 8.
            lo = (act - hi.to(tl.float32)).to(lo_ptr.dtype.element_ty)
            tl.store(lo_ptr + a_off, lo, mask=a_mask)


@triton.jit
def _decode_down_kernel(
    hi_ptr,  # [P, I]
    lo_ptr,  # [P, I] (read with SPLIT only)
    w2_ptr,  # [N, H, I]
    ids_ptr,  # [P]
    y_ptr,  # [P, H] fp32, unweighted expert outputs by pair
    stride2,  # elements between w2 rows (H*I dense; larger for arena slots)
    hw2_ptr,  # [Nh, H, I] host bank (HOST); else any bank
    hstride2,
    slot_of_ptr,  # [Nh] int32 (FILL), as gate/up's
    cols_ptr,  # [N] int32 (PARTIAL), as gate/up's
    P,
    H,
    I,  # noqa: E741 (the shape legend's name)
    BLOCK_P: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PREC: tl.constexpr,
    SPLIT: tl.constexpr,
    HOST: tl.constexpr,
    FILL: tl.constexpr,
    PARTIAL: tl.constexpr,
    PDL: tl.constexpr,
):
    enter(PDL)  # first: pdl.py
    pid = tl.program_id(0)
    n_nblk = tl.cdiv(H, BLOCK_N)
    row, n_before, same, rank, n_group = _group(ids_ptr, pid // n_nblk, P, BLOCK_P)
    if _skipped(row, HOST):
        return
    if n_before > 0:
        return
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = (pid % n_nblk) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < H
    k_end = I  # the columns of I this row's dot runs over
    if PARTIAL:
        k_end = _row_cols(cols_ptr, row, I)
    w_row = _row_ptr(w2_ptr, stride2, hw2_ptr, hstride2, row, HOST)
    w_ptrs = w_row + offs_n[None, :] * I + offs_k[:, None]
    if FILL:
        f_row, f_ok = _fill_row(w2_ptr, stride2, slot_of_ptr, row)
        f_ptrs = f_row + offs_n[None, :] * I + offs_k[:, None]
    for m0 in range(0, n_group, BLOCK_M):
        pair = _members(same, rank, m0, BLOCK_M, BLOCK_P)
        valid = (m0 + offs_m) < n_group
        a_off = pair[:, None] * I + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, k_end, BLOCK_K):
            k_mask = (k0 + offs_k) < k_end  # both loads: past c the act and the slot are stale
            a_mask = valid[:, None] & k_mask[None, :]
            w = tl.load(w_ptrs + k0, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            if FILL:  # noqa: SIM102 - a compile-time branch around a run-time one (Triton)
                if f_ok:
                    tl.store(f_ptrs + k0, w, mask=k_mask[:, None] & n_mask[None, :])
            acc = tl.dot(
                tl.load(hi_ptr + a_off + k0, mask=a_mask, other=0.0), w, acc, input_precision=PREC
            )
            if SPLIT:  # two dots on one weight tile: free in a bandwidth-bound kernel
                acc = tl.dot(tl.load(lo_ptr + a_off + k0, mask=a_mask, other=0.0), w, acc)
        y_ptrs = y_ptr + pair[:, None] * H + offs_n[None, :]
        tl.store(y_ptrs, acc, mask=valid[:, None] & n_mask[None, :])


def fused_moe_decode(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    tiles: dict[str, int] | None = None,
    host_w13: torch.Tensor | None = None,
    host_w2: torch.Tensor | None = None,
    add: torch.Tensor | None = None,
    rows_settled: bool = False,
    fill_slot_of: torch.Tensor | None = None,
    slot_cols: torch.Tensor | None = None,
    collect: CpuAnswer | None = None,
) -> torch.Tensor:
    """Bandwidth-bound path for few pairs; no host sync, safe under CUDA-graph capture. With
    host banks (pinned host memory on CUDA), ids <= -2 name their rows (`reference.host_ids`):
    the kernels read those experts over the link themselves, with no copy into a slot; with
    `fill_slot_of` [Nh] int32 (fill-through) they also store what they read of host row r into
    slot fill_slot_of[r] of w13 / w2 where that is >= 0.
    `add` [T, H]: added before the rounding and zeroed, in the summing kernel.
    `collect`: the summing kernel waits for the CPU worker's answer to the last fill plan's post
    (if it posted) and adds it before the rounding (cpu_answer.py).
    `rows_settled`: topk_ids were written two or more kernels before this call's first launch
    (the fill plan's rows): under FREETOKEN_PDL's `prefetch`, gate/up asks L2 for its rows
    before its wait (kernels/triton/pdl.py).
    `slot_cols` [N] int32: bank row r holds columns [0, slot_cols[r]) of I only (the split
    expert's device half, `reference.fused_moe`); gate/up skips its blocks past them and down
    masks its loads there."""
    t, h, i, k = _check(hidden, w13, w2, topk_ids, topk_weights, out)
    check_add(add, hidden)
    check_slot_cols(slot_cols, w13)
    partial = slot_cols is not None
    cols = slot_cols if partial else topk_ids  # never read without PARTIAL
    host = host_w13 is not None
    if host:
        _check_host(hidden, w13, host_w13, host_w2)
    else:
        host_w13, host_w2 = w13, w2  # never read: HOST is off
    fill = fill_slot_of is not None
    if fill:
        assert host and fill_slot_of.dtype == torch.int32, "fill-through needs host banks"
        assert fill_slot_of.numel() == host_w13.shape[0], "fill_slot_of: one slot a host row"
    slot_of = fill_slot_of if fill else topk_ids  # never read without FILL
    p = t * k
    assert p <= DECODE_MAX_PAIRS, f"decode path takes at most {DECODE_MAX_PAIRS} pairs, got {p}"
    if out is None:
        out = torch.empty_like(hidden)
    if p == 0:  # no token: nothing to add either
        return out
    c = _tiles(DECODE_TILES, h, i, tiles)
    block_p, prec = max(16, triton.next_power_of_2(p)), _dot_precision(hidden.dtype)
    split = hidden.dtype != torch.float32  # act as hi + lo 16-bit parts; fp32 needs no split
    act = torch.empty(2 if split else 1, p, i, dtype=hidden.dtype, device=hidden.device)
    y = torch.empty(p, h, dtype=torch.float32, device=hidden.device)  # [P, H]
    _decode_gate_up_kernel[(p * triton.cdiv(i, c["BLOCK_I"]),)](
        hidden, w13, topk_ids, act[0], act[-1], w13.stride(0), host_w13, host_w13.stride(0),
        slot_of, cols, p, h, i,
        K=k, BLOCK_P=block_p, BLOCK_M=c["BLOCK_M"], BLOCK_I=c["BLOCK_I"], BLOCK_H=c["BLOCK_H"],
        PREC=prec, SPLIT=split, HOST=host, FILL=fill, PARTIAL=partial, num_warps=c["WARPS_UP"],
        num_stages=c["STAGES_UP"],
        **pdl_launch(hidden.device, heavy=True, prefetch=rows_settled),
    )  # fmt: skip
    _decode_down_kernel[(p * triton.cdiv(h, c["BLOCK_N"]),)](
        act[0], act[-1], w2, topk_ids, y, w2.stride(0), host_w2, host_w2.stride(0), slot_of,
        cols, p, h, i,
        BLOCK_P=block_p, BLOCK_M=c["BLOCK_M"], BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"],
        PREC=prec, SPLIT=split, HOST=host, FILL=fill, PARTIAL=partial,
        num_warps=c["WARPS_DOWN"],
        num_stages=c["STAGES_DOWN"],
        **pdl_launch(hidden.device, heavy=True),
    )  # fmt: skip
    if collect is None:  # unused pointers (COLLECT is off)
        state, ctrl, answer, timeout = topk_ids, topk_ids, y, 0
    else:
        state, ctrl, answer = collect.state, collect.box.ctrl, collect.box.out
        timeout = timeout_ticks(collect.timeout_s)
    _sum_over_k_kernel[(t, triton.cdiv(h, c["SUM_BLOCK"]))](
        y, topk_ids, topk_weights, out, out if add is None else add, state, ctrl, answer,
        timeout, h,
        K=k, BLOCK=c["SUM_BLOCK"], HOST=host, ADD=add is not None, COLLECT=collect is not None,
        SYS=sys_ordering(),
        **pdl_launch(hidden.device),
    )  # fmt: skip
    return out
