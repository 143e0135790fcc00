"""Prefill path of the Triton fused MoE: pairs sorted by row on the device, grouped GEMMs.

See `fused_moe.py`'s docstring for the overview of both paths, the shape legend and determinism.
"""

import torch
import triton
import triton.language as tl

from freetoken_agent.kernels.reference import check_add
from freetoken_agent.kernels.triton.moe_common import (
    PREFILL_TILES,
    _check,
    _dot_precision,
    _sum_over_k_kernel,
    _tiles,
)
from freetoken_agent.kernels.triton.pdl import launch as pdl_launch


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
    if topk_ids.numel() == 0:
        return
    order, blk_row, blk_start, blk_end = align_pairs_by_row(topk_ids.view(-1), w13.shape[0],
                                                           c["BLOCK_M"])  # fmt: skip
    run_blocks(hidden, w13, w2, (order, blk_row, blk_start, blk_end), topk_ids, topk_weights,
               out, c, add)  # fmt: skip


def run_blocks(hidden, w13, w2, blocks, topk_ids, topk_weights, out, c: dict[str, int],
               add=None) -> None:  # fmt: skip
    """The grouped GEMMs over pairs sorted into `blocks` (`align_pairs_by_row`'s order, bank
    row, start and end per block; a block of row -1 is skipped), then the sum over k of the
    pairs whose id in topk_ids is live (+ add, then zeroed) into out: one token chunk."""
    t, h = hidden.shape
    i, k = w13.shape[1] // 2, topk_ids.shape[1]
    p = t * k
    assert p * max(h, i) < 2**31, "kernel offsets are int32: lower CHUNK_PAIRS"
    order, blk_row, blk_start, blk_end = blocks
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
        y, topk_ids, topk_weights, out, out if add is None else add, topk_ids, topk_ids, y, 0, h,
        K=k, BLOCK=c["SUM_BLOCK"], HOST=False, ADD=add is not None, COLLECT=False, SYS=False,
        **pdl_launch(hidden.device),
    )  # fmt: skip
