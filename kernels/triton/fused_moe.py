"""Fused MoE expert computation over rows of weight banks: Triton kernels and launchers.

Shape legend (the twin is `kernels/reference.py`):
  T tokens, H hidden, I expert intermediate width, K top-k, N rows in a weight bank,
  P = T * K (token, choice) pairs; pair p = t * K + k. S sorted positions (pairs grouped by row).
  hidden [T, H]; w13 [N, 2I, H] (gate rows 0..I-1, up rows I..2I-1); w2 [N, H, I];
  w13 / w2 rows may be strided (stride(0) any, each row's block dense: arena slots);
  topk_ids [T, K] int32/int64 (negative = skip); topk_weights [T, K] fp32; out [T, H].
  Expert: y = w2 @ (silu(w13[:I] @ x) * (w13[I:] @ x)).

Two paths, both free of host syncs (grids come from T, K, H, I, N only), so both can be captured
in a CUDA graph, and both end with `_sum_over_k_kernel` (y [P, H] fp32 -> out [T, H]):
- decode (few pairs, bandwidth-bound): pairs that picked the same row form a group led by its
  first pair; `_decode_gate_up_kernel` (act [P, I]) and `_decode_down_kernel` (y) run one
  program per (pair, output block), the leader computing its whole group with tl.dot, so a row's
  weights are read once per batch, and the other programs exit at once. No sort is needed.
- prefill (many pairs, compute-bound): pairs are sorted by row on the device, then grouped GEMMs
  with tl.dot over blocks of pairs of one row.
Why tl.dot even for one token: Triton software-pipelines (multi-buffers) only loads that feed a
dot, and the streamed weights need those loads in flight to reach HBM bandwidth.

Determinism: no atomics; every output element sums k = 0..K-1 in a fixed order, and a pair's
arithmetic does not depend on the other pairs of its tile (tl.dot rows are independent; masked
rows are zeros), so on either path a token's bits do not depend on the rest of the batch. Tiles
are keyed by (H, I), never by T, for the same reason.
"""

import torch
import triton
import triton.language as tl

from freetoken_agent.kernels.fused_moe import PREFILL_CHUNK_PAIRS
from freetoken_agent.kernels.reference import check_add, check_host_banks, check_moe_shapes

# fmt: off
# Tiles keyed by (H, I); "default" covers other shapes. First guesses for the H200;
# `python -m freetoken_agent.bench.moe_kernel` sweeps alternatives to tune them.
DECODE_TILES: dict[tuple[int, int] | str, dict[str, int]] = {
    # gate/up: BLOCK_M members x BLOCK_I outputs, H walked in BLOCK_H steps (tl.dot needs every
    # dim >= 16); down: BLOCK_M members x BLOCK_N outputs, I walked in BLOCK_K steps. Small output
    # blocks give T=1, K=8 enough programs (384 and 512) to keep 132 SMs streaming; compiled for
    # sm_90 these use no local memory and keep 3-4 programs x 3 weight tiles in flight per SM.
    "default": dict(
        BLOCK_M=16, BLOCK_I=16, BLOCK_H=256, WARPS_UP=4, STAGES_UP=4,
        BLOCK_N=32, BLOCK_K=128, WARPS_DOWN=4, STAGES_DOWN=4, SUM_BLOCK=512,
    ),
    # Measured on an H200 (bench/moe_kernel.py sweep, graph-replayed, 8 layers' rows): against
    # the default, H=2048 I=768 decodes T=1 in 29.6 vs 32.9 us/layer (60% vs 54% of copy
    # bandwidth) and T=4 in 86.7 vs 97.4; H=2048 I=512: 24.3 vs 26.1 and 65.5 vs 76.3.
    (2048, 768): dict(
        BLOCK_M=16, BLOCK_I=32, BLOCK_H=128, WARPS_UP=4, STAGES_UP=3,
        BLOCK_N=64, BLOCK_K=128, WARPS_DOWN=8, STAGES_DOWN=3, SUM_BLOCK=512,
    ),
    (2048, 512): dict(
        BLOCK_M=16, BLOCK_I=32, BLOCK_H=128, WARPS_UP=4, STAGES_UP=3,
        BLOCK_N=64, BLOCK_K=128, WARPS_DOWN=8, STAGES_DOWN=3, SUM_BLOCK=512,
    ),
}
PREFILL_TILES: dict[tuple[int, int] | str, dict[str, int]] = {
    # CHUNK_PAIRS: pairs per launch (the dispatcher passes its max_pairs; the default is its
    # PREFILL_CHUNK_PAIRS).
    "default": dict(
        BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, WARPS_UP=8, STAGES_UP=3,
        DOWN_BLOCK_N=128, DOWN_BLOCK_K=64, WARPS_DOWN=4, STAGES_DOWN=4,
        SUM_BLOCK=512, CHUNK_PAIRS=PREFILL_CHUNK_PAIRS,
    ),
}
# fmt: on
# The decode kernels hold all P ids and a [BLOCK_M, P] member selection in every program; past
# 128 pairs that spills registers on sm_90 (and sorting by row pays off anyway).
DECODE_MAX_PAIRS = 128


def _tiles(table: dict, h: int, i: int, override: dict | None) -> dict[str, int]:
    return {**table.get((h, i), table["default"]), **(override or {})}


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 operands would default to TF32 on tensor cores (10-bit mantissa); keep them exact.
    return "ieee" if dtype == torch.float32 else "tf32"


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
def _decode_gate_up_kernel(
    x_ptr,  # [T, H]
    w13_ptr,  # [N, 2I, H]
    ids_ptr,  # [P]
    hi_ptr,  # [P, I] act, or with SPLIT its high 16-bit part
    lo_ptr,  # [P, I] with SPLIT: act - hi, rounded to 16 bits
    stride13,  # elements between w13 rows (2I*H dense; larger for arena slots)
    hw13_ptr,  # [Nh, 2I, H] host bank (HOST), read over the link; else any bank
    hstride13,
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
):
    pid = tl.program_id(0)
    n_iblk = tl.cdiv(I, BLOCK_I)
    row, n_before, same, rank, n_group = _group(ids_ptr, pid // n_iblk, P, BLOCK_P)
    if _skipped(row, HOST):
        return
    if n_before > 0:
        return
    offs_m = tl.arange(0, BLOCK_M)
    offs_i = (pid % n_iblk) * BLOCK_I + tl.arange(0, BLOCK_I)
    offs_h = tl.arange(0, BLOCK_H)
    i_mask = offs_i < I
    # [BLOCK_H, BLOCK_I] tiles of the gate rows; the up rows sit I * H elements further.
    w_row = _row_ptr(w13_ptr, stride13, hw13_ptr, hstride13, row, HOST)
    w_ptrs = w_row + offs_i[None, :] * H + offs_h[:, None]
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
):
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
    w_row = _row_ptr(w2_ptr, stride2, hw2_ptr, hstride2, row, HOST)
    w_ptrs = w_row + offs_n[None, :] * I + offs_k[:, None]
    for m0 in range(0, n_group, BLOCK_M):
        pair = _members(same, rank, m0, BLOCK_M, BLOCK_P)
        valid = (m0 + offs_m) < n_group
        a_off = pair[:, None] * I + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            k_mask = (k0 + offs_k) < I
            a_mask = valid[:, None] & k_mask[None, :]
            w = tl.load(w_ptrs + k0, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            acc = tl.dot(
                tl.load(hi_ptr + a_off + k0, mask=a_mask, other=0.0), w, acc, input_precision=PREC
            )
            if SPLIT:  # two dots on one weight tile: free in a bandwidth-bound kernel
                acc = tl.dot(tl.load(lo_ptr + a_off + k0, mask=a_mask, other=0.0), w, acc)
        y_ptrs = y_ptr + pair[:, None] * H + offs_n[None, :]
        tl.store(y_ptrs, acc, mask=valid[:, None] & n_mask[None, :])


@triton.jit
def _block(blk_row_ptr, blk_start_ptr, blk_end_ptr, b, BLOCK_M: tl.constexpr):
    """Row of block b (-1: unused), its sorted positions [BLOCK_M] and which of them it owns."""
    offs_s = tl.load(blk_start_ptr + b) + tl.arange(0, BLOCK_M)
    valid = offs_s < tl.load(blk_end_ptr + b)  # tail block of a row: masked rows are zeros
    return tl.load(blk_row_ptr + b), offs_s, valid


@triton.jit
def _grouped_gate_up_kernel(
    x_ptr,  # [T, H]
    w13_ptr,  # [N, 2I, H]
    order_ptr,  # [S] pair at each sorted position
    blk_row_ptr,  # [B] bank row of each block, -1 = unused block
    blk_start_ptr,  # [B] first sorted position of the block
    blk_end_ptr,  # [B] end of the row's positions (the block stops there)
    act_ptr,  # [S, I] hidden.dtype, indexed by sorted position
    stride13,  # elements between w13 rows
    H,
    I,  # noqa: E741 (the shape legend's name)
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PREC: tl.constexpr,
):
    # Output blocks vary fastest: the programs of one block of pairs run together and share its
    # gathered x rows in L2, and consecutive blocks of one row share its weights.
    pid = tl.program_id(0)
    n_nblk = tl.cdiv(I, BLOCK_N)
    row, offs_s, valid = _block(blk_row_ptr, blk_start_ptr, blk_end_ptr, pid // n_nblk, BLOCK_M)
    if row < 0:
        return
    pair = tl.load(order_ptr + offs_s, mask=valid, other=0)
    offs_n = (pid % n_nblk) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < I
    x_ptrs = x_ptr + (pair // K)[:, None] * H + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = w13_ptr + row.to(tl.int64) * stride13 + offs_n[None, :] * H + offs_k[:, None]
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k_mask = (k0 + offs_k) < H
        x = tl.load(x_ptrs + k0, mask=valid[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & n_mask[None, :]
        wg = tl.load(w_ptrs + k0, mask=w_mask, other=0.0)  # [BLOCK_K, BLOCK_N]
        wu = tl.load(w_ptrs + I * H + k0, mask=w_mask, other=0.0)
        acc_g = tl.dot(x, wg, acc_g, input_precision=PREC)
        acc_u = tl.dot(x, wu, acc_u, input_precision=PREC)
    # SwiGLU in fp32, then one rounding to the weight dtype: the down GEMM's tensor cores need
    # 16-bit operands (HF rounds here too).
    act = acc_g * tl.sigmoid(acc_g) * acc_u
    a_ptrs = act_ptr + offs_s[:, None] * I + offs_n[None, :]
    tl.store(a_ptrs, act.to(act_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


@triton.jit
def _grouped_down_kernel(
    act_ptr,  # [S, I]
    w2_ptr,  # [N, H, I]
    order_ptr,  # [S]
    blk_row_ptr,  # [B]
    blk_start_ptr,  # [B]
    blk_end_ptr,  # [B]
    y_ptr,  # [P, H] fp32, unweighted expert outputs by pair
    stride2,  # elements between w2 rows
    H,
    I,  # noqa: E741 (the shape legend's name)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PREC: tl.constexpr,
):
    pid = tl.program_id(0)
    n_nblk = tl.cdiv(H, BLOCK_N)
    row, offs_s, valid = _block(blk_row_ptr, blk_start_ptr, blk_end_ptr, pid // n_nblk, BLOCK_M)
    if row < 0:
        return
    offs_n = (pid % n_nblk) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < H
    a_ptrs = act_ptr + offs_s[:, None] * I + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = w2_ptr + row.to(tl.int64) * stride2 + offs_n[None, :] * I + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        k_mask = (k0 + offs_k) < I
        a = tl.load(a_ptrs + k0, mask=valid[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs + k0, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=PREC)
    pair = tl.load(order_ptr + offs_s, mask=valid, other=0)
    y_ptrs = y_ptr + pair[:, None] * H + offs_n[None, :]
    tl.store(y_ptrs, acc, mask=valid[:, None] & n_mask[None, :])


@triton.jit
def _sum_over_k_kernel(
    y_ptr,  # [P, H] fp32
    ids_ptr,  # [P]
    wts_ptr,  # [P] fp32
    out_ptr,  # [T, H]
    add_ptr,  # [T, H] (ADD): added before the rounding, then zeroed
    H,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
    HOST: tl.constexpr,
    ADD: tl.constexpr,
):
    # A separate pass because the pairs of one token live in different row groups; summing here
    # in k order keeps the result deterministic without atomics.
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in range(K):
        p = t * K + k
        pair_id = tl.load(ids_ptr + p)
        if HOST:  # noqa: SIM108 - compile-time; a skipped pair's y was never written
            live = pair_id != -1
        else:
            live = pair_id >= 0
        wt = tl.where(live, tl.load(wts_ptr + p), 0.0)
        y_mask = offs < tl.where(live, H, 0)
        acc += wt * tl.load(y_ptr + p * H + offs, mask=y_mask, other=0.0)
    if ADD:  # the part summed elsewhere (the CPU branch), consumed: zeros for the next use
        acc += tl.load(add_ptr + t * H + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(add_ptr + t * H + offs, tl.zeros((BLOCK,), dtype=add_ptr.dtype.element_ty),
                 mask=mask)  # fmt: skip
    tl.store(out_ptr + t * H + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _check(hidden, w13, w2, topk_ids, topk_weights, out) -> tuple[int, int, int, int]:
    t, h, i, k = check_moe_shapes(hidden, w13, w2, topk_ids, topk_weights, out)
    tensors = [hidden, topk_ids, topk_weights] + ([out] if out is not None else [])
    assert all(x.is_contiguous() for x in tensors), "fused_moe needs contiguous tensors"
    # Bank rows may sit at any stride (arena slots interleave w13 and w2 rows, engine/arena.py);
    # each row's [2I, H] / [H, I] block must be dense, which is what the kernels index.
    assert w13.stride()[1:] == (h, 1) and w2.stride()[1:] == (i, 1), (
        f"fused_moe needs dense rows: w13 strides {w13.stride()}, w2 strides {w2.stride()}"
    )
    n = w13.shape[0]
    assert n <= 1 or (w13.stride(0) >= 2 * i * h and w2.stride(0) >= h * i), "bank rows overlap"
    tensors += [w13, w2]
    assert all(x.device == hidden.device for x in tensors), "fused_moe tensors on one device"
    assert hidden.numel() < 2**31, "token offsets are int32"
    return t, h, i, k


def _check_host(hidden, w13, host_w13, host_w2) -> None:
    check_host_banks(w13, host_w13, host_w2)
    h, i = host_w13.shape[2], host_w13.shape[1] // 2
    assert host_w13.stride()[1:] == (h, 1) and host_w2.stride()[1:] == (i, 1), (
        "fused_moe needs dense host bank rows"
    )
    for bank in (host_w13, host_w2):  # the kernels reach pinned memory through its mapping
        assert bank.device == hidden.device or (bank.device.type == "cpu" and bank.is_pinned()), (
            f"host banks must be pinned host memory (or on {hidden.device}), got {bank.device}"
        )


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
) -> torch.Tensor:
    """Bandwidth-bound path for few pairs; no host sync, safe under CUDA-graph capture. With
    host banks (pinned host memory on CUDA), ids <= -2 name their rows (`reference.host_ids`):
    the kernels read those experts over the link themselves, with no copy into a slot.
    `add` [T, H]: added before the rounding and zeroed, in the summing kernel."""
    t, h, i, k = _check(hidden, w13, w2, topk_ids, topk_weights, out)
    check_add(add, hidden)
    host = host_w13 is not None
    if host:
        _check_host(hidden, w13, host_w13, host_w2)
    else:
        host_w13, host_w2 = w13, w2  # never read: HOST is off
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
        p, h, i,
        K=k, BLOCK_P=block_p, BLOCK_M=c["BLOCK_M"], BLOCK_I=c["BLOCK_I"], BLOCK_H=c["BLOCK_H"],
        PREC=prec, SPLIT=split, HOST=host, num_warps=c["WARPS_UP"], num_stages=c["STAGES_UP"],
    )  # fmt: skip
    _decode_down_kernel[(p * triton.cdiv(h, c["BLOCK_N"]),)](
        act[0], act[-1], w2, topk_ids, y, w2.stride(0), host_w2, host_w2.stride(0), p, h, i,
        BLOCK_P=block_p, BLOCK_M=c["BLOCK_M"], BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"],
        PREC=prec, SPLIT=split, HOST=host, num_warps=c["WARPS_DOWN"],
        num_stages=c["STAGES_DOWN"],
    )  # fmt: skip
    _sum_over_k_kernel[(t, triton.cdiv(h, c["SUM_BLOCK"]))](
        y, topk_ids, topk_weights, out, out if add is None else add, h,
        K=k, BLOCK=c["SUM_BLOCK"], HOST=host, ADD=add is not None,
    )  # fmt: skip
    return out


def align_pairs_by_row(
    ids: torch.Tensor, n_rows: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group pairs by bank row into blocks of at most block_m, with torch ops and no host sync.

    ids: [P] row ids (negative = skip). Returns order [S=P] (pair at each sorted position; skipped
    pairs last, never read), and per block b of an upper-bound count B: row [B] (-1 = unused),
    start [B] and end [B] sorted positions (a block covers start .. min(start + block_m, end)).
    """
    p, dev = ids.numel(), ids.device
    key = torch.where(ids < 0, n_rows, ids).long()  # [P] skipped pairs sort after every row
    order = torch.argsort(key, stable=True)  # [S] stable: token order inside a row
    bounds = torch.searchsorted(key[order], torch.arange(n_rows + 1, device=dev))  # [N+1]
    counts = bounds[1:] - bounds[:-1]  # [N] pairs per row (bincount would sync on CUDA)
    blocks = (counts + block_m - 1) // block_m  # [N]
    blocks_end = torch.cumsum(blocks, 0)  # [N]
    # Each row with pairs adds at most one partial block: a bound known without reading ids.
    b = torch.arange(triton.cdiv(p, block_m) + min(n_rows, p), device=dev)  # [B]
    row = torch.searchsorted(blocks_end, b, right=True)  # [B] n_rows past the last used block
    rc = row.clamp(max=n_rows - 1)
    start = bounds[rc] + (b - (blocks_end[rc] - blocks[rc])) * block_m
    end = bounds[rc + 1]
    return order, torch.where(row < n_rows, row, -1), start, end


def fused_moe_prefill(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    tiles: dict[str, int] | None = None,
    add: torch.Tensor | None = None,
) -> torch.Tensor:
    """Compute-bound path: pairs sorted by row, grouped GEMMs, then a sum over k per token
    (which adds `add` and zeroes it, as the decode path's does)."""
    t, h, i, k = _check(hidden, w13, w2, topk_ids, topk_weights, out)
    check_add(add, hidden)
    if out is None:
        out = torch.empty_like(hidden)
    c = _tiles(PREFILL_TILES, h, i, tiles)
    chunk = max(1, c["CHUNK_PAIRS"] // max(k, 1))  # tokens per launch
    for t0 in range(0, t, chunk):
        t1 = min(t, t0 + chunk)
        part = None if add is None else add[t0:t1]
        _prefill_chunk(hidden[t0:t1], w13, w2, topk_ids[t0:t1], topk_weights[t0:t1], out[t0:t1],
                       c, part)  # fmt: skip
    return out


def _prefill_chunk(
    hidden, w13, w2, topk_ids, topk_weights, out, c: dict[str, int], add=None
) -> None:
    t, h = hidden.shape
    n, i, k = w13.shape[0], w13.shape[1] // 2, topk_ids.shape[1]
    p = t * k
    if p == 0:
        return
    assert p * max(h, i) < 2**31, "kernel offsets are int32: lower CHUNK_PAIRS"
    order, blk_row, blk_start, blk_end = align_pairs_by_row(topk_ids.view(-1), n, c["BLOCK_M"])
    n_blk = blk_row.numel()
    prec = _dot_precision(hidden.dtype)
    act = torch.empty(p, i, dtype=hidden.dtype, device=hidden.device)  # [S, I]
    y = torch.empty(p, h, dtype=torch.float32, device=hidden.device)  # [P, H]
    _grouped_gate_up_kernel[(n_blk * triton.cdiv(i, c["BLOCK_N"]),)](
        hidden, w13, order, blk_row, blk_start, blk_end, act, w13.stride(0), h, i,
        K=k, BLOCK_M=c["BLOCK_M"], BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"], PREC=prec,
        num_warps=c["WARPS_UP"], num_stages=c["STAGES_UP"],
    )  # fmt: skip
    _grouped_down_kernel[(n_blk * triton.cdiv(h, c["DOWN_BLOCK_N"]),)](
        act, w2, order, blk_row, blk_start, blk_end, y, w2.stride(0), h, i,
        BLOCK_M=c["BLOCK_M"], BLOCK_N=c["DOWN_BLOCK_N"], BLOCK_K=c["DOWN_BLOCK_K"], PREC=prec,
        num_warps=c["WARPS_DOWN"], num_stages=c["STAGES_DOWN"],
    )  # fmt: skip
    _sum_over_k_kernel[(t, triton.cdiv(h, c["SUM_BLOCK"]))](
        y, topk_ids, topk_weights, out, out if add is None else add, h,
        K=k, BLOCK=c["SUM_BLOCK"], HOST=False, ADD=add is not None,
    )  # fmt: skip
