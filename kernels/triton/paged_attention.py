"""Paged attention in Triton: one kernel for prefill, chunked prefill, decode and mixed batches.

Each program owns BLOCK_M query rows = BLOCK_Q tokens of one sequence x HEADS query heads of one
GQA group (row r is token r // HEADS, head r % HEADS). Packing the group's heads into the rows
means every K/V tile is loaded once per group, not once per query head: decode reads the cache
G times less, and a decode tile still has the 16 rows tl.dot needs. The program walks kv tiles
of BLOCK_N positions with an online softmax (flash attention 2), gathering rows through the page
table, only up to the block's causal bound and from its window start. Tiles that no row masks
run without mask arithmetic; only the diagonal and window-edge tiles compute a mask.

Split-KV ("flash decoding"): when the batch has too few (q block, kv head) programs to fill the
GPU (decode at batch 1 has Hkv of them), a second grid axis cuts each sequence's kv range into
NS pieces; programs write unnormalised partials (acc, running max, running sum), combined by the
last program of each (q block, kv head) to finish when the caller lends a counter buffer
(`new_counters`), else by a second kernel (kernels/triton/split_combine.py). NS and every grid
size come from python ints, so a captured CUDA graph replays correctly whatever kv_lens hold;
each sequence's range is divided on the device.
"""

# Shape legend: T query tokens (all sequences, flattened), B sequences, Hq / Hkv query / kv heads,
# G = Hq // Hkv, D head dim (D_PAD: padded to a power of two >= 16), P pages of S tokens,
# NS kv splits. Rows: BLOCK_M = BLOCK_Q tokens x HEADS heads; columns: BLOCK_N kv positions.

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from freetoken_agent.kernels.triton.attention_plan import (
    _SPLITS_PAD,
    COUNTERS,
    SHORT_TILES,
    Tiles,
    plan_launch,
)
from freetoken_agent.kernels.triton.pdl import enter
from freetoken_agent.kernels.triton.pdl import launch as pdl_launch
from freetoken_agent.kernels.triton.split_combine import (
    COMBINE_CHUNK,
    SPLIT_CHUNK,
    _combine_rows,
    _combine_splits_kernel,
)

_LOG2E = 1.4426950408889634
# Stands in for "no window": positions stay below 2**30, so p - _NO_WINDOW never reaches a real
# kv position and the window arithmetic needs no branch.
_NO_WINDOW = 1 << 30


@triton.jit
def _find_seq(cu_q_lens_ptr, pid, num_seqs, BLOCK_Q: tl.constexpr):
    # Sequence b owns q blocks [cu[b] // BLOCK_Q + b, cu[b + 1] // BLOCK_Q + b + 1): a strictly
    # increasing start per sequence, at least cdiv(q_len, BLOCK_Q) blocks each, and T // BLOCK_Q
    # + B blocks in all, with no prefix sum over the batch. Binary search for the last start <=
    # pid. The loop variables start as tensors so the while loop carries one type.
    lo = pid * 0
    hi = lo + num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(cu_q_lens_ptr + mid) // BLOCK_Q + mid
        if start <= pid:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _load_kv_tile(ptrs, kv_ok, d_ok, MASK_KV: tl.constexpr, EVEN_D: tl.constexpr):
    # ptrs: [BLOCK_N, D_PAD]. Masks only where they can be false (constexpr-selected).
    if MASK_KV:
        if EVEN_D:
            tile = tl.load(ptrs, mask=kv_ok[:, None], other=0.0)
        else:
            tile = tl.load(ptrs, mask=kv_ok[:, None] & d_ok[None, :], other=0.0)
    elif EVEN_D:
        tile = tl.load(ptrs)
    else:
        tile = tl.load(ptrs, mask=d_ok[None, :], other=0.0)
    return tile


@triton.jit
def _attend_tiles(
    # acc, q [BLOCK_M, D_PAD]; l_i, m_i [BLOCK_M]; pt_ptr: this sequence's page-table row
    acc, l_i, m_i, q, k_ptr, v_ptr, pt_ptr,
    n_start, n_end, kv_len, pos, lo_excl, qk_scale, stride_kp, stride_ks,
    BLOCK_N: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    MASKED: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_DIM
    for n in range(n_start, n_end):
        j = n * BLOCK_N + offs_n  # [BLOCK_N] kv positions
        kv_ok = j < kv_len
        # One page id per kv position (duplicates hit L1): works for any page size, also pages
        # smaller than BLOCK_N; PAGE is a constexpr power of two, so // and % are shifts/masks.
        if MASKED:
            page = tl.load(pt_ptr + j // PAGE, mask=kv_ok, other=0)
        else:
            page = tl.load(pt_ptr + j // PAGE)
        # int64: P * S * Hkv * D can pass 2**31 elements in a large cache.
        row = page.to(tl.int64) * stride_kp + (j % PAGE) * stride_ks  # [BLOCK_N]
        kv_offs = row[:, None] + offs_d[None, :]  # [BLOCK_N, D_PAD]
        k = _load_kv_tile(k_ptr + kv_offs, kv_ok, d_ok, MASKED, HEAD_DIM == D_PAD)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        if MASKED:
            # Causal and window mask per row; kv_ok is implied for real rows (pos < kv_len).
            ok = (j[None, :] <= pos[:, None]) & (j[None, :] > lo_excl[:, None])
            s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])  # scores are in log2 units (qk_scale carries log2 e)
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_kv_tile(v_ptr + kv_offs, kv_ok, d_ok, MASKED, HEAD_DIM == D_PAD)
        if UPCAST:
            v = v.to(tl.float32)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


# Arguments that change from call to call (batch size, chunk length, context length) are not
# specialised: Triton would compile a new variant whenever one of them first turns out
# divisible by 16 (or equal to 1), which on the device put 1-2 s compiles inside agent turns
# (a prefill chunk of a new length, a page table of a new width).
@triton.jit(
    do_not_specialize=[
        "window", "num_seqs", "q_blocks_per_seq", "num_splits", "min_split_tiles", "stride_pt"
    ]
)  # fmt: skip
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr,  # q, out [T, Hq, D]; k, v [P, S, Hkv, D]
    part_acc_ptr, part_m_ptr, part_l_ptr,  # [T, Hq, NS, D], [T, Hq, NS], [T, Hq, NS] fp32
    count_ptr,  # [>= grid axis 0] int32, 0 between launches (COMBINE)
    page_table_ptr, cu_q_lens_ptr, kv_lens_ptr,  # [B, max_pages], [B + 1], [B]
    qk_scale, window, num_seqs, q_blocks_per_seq, head_progs, num_splits, min_split_tiles,
    num_q_heads, stride_qt, stride_qh, stride_kp, stride_ks, stride_kh, stride_ot, stride_oh,
    stride_pt,
    GROUP: tl.constexpr, HEADS: tl.constexpr, HEAD_CHUNKS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    DIRECT: tl.constexpr, SPLIT: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    COMBINE: tl.constexpr, SPLITS_PAD: tl.constexpr, CHUNK: tl.constexpr,
    SHORT_TILES: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    # Before the wait (pdl.py's rule, with its one exception here): index arithmetic and
    # loads of the step's lengths only. cu_q_lens and kv_lens come from the step's input
    # copies (or a graph's static arange), which completed before the step's first kernel
    # started, so before any kernel still in flight; no kernel writes them. So the chain of
    # dependent loads that starts every program (cu_q_lens -> the sequence -> kv_len -> its
    # tile ranges) runs while the kernel before (qk-norm, RoPE and the K/V store) ends. q and
    # K/V, which that kernel writes, and every return and store come after the wait.
    # grid: (q blocks x head_progs, NS), head_progs = Hkv * HEAD_CHUNKS. The head is the fast
    # index and q blocks run last to first: a sequence's last blocks see the most kv tiles
    # (causal), so the longest programs start first and the tail of the grid is short ones.
    pid_h = tl.program_id(0) % head_progs
    pid_q = tl.num_programs(0) // head_progs - 1 - tl.program_id(0) // head_progs
    split = tl.program_id(1)
    if DIRECT:  # q_blocks_per_seq = cdiv(max_q_len, BLOCK_Q) blocks per sequence
        seq = pid_q // q_blocks_per_seq
        qb = pid_q % q_blocks_per_seq
    else:
        seq = _find_seq(cu_q_lens_ptr, pid_q, num_seqs, BLOCK_Q)
        qb = pid_q - (tl.load(cu_q_lens_ptr + seq) // BLOCK_Q + seq)
    q_start = tl.load(cu_q_lens_ptr + seq)
    q_len = tl.load(cu_q_lens_ptr + seq + 1) - q_start
    kv_len = tl.load(kv_lens_ptr + seq)
    kvh = pid_h // HEAD_CHUNKS
    # Tile ranges of this block, in units of BLOCK_N: [n_lo, n_hi) is everything some row sees;
    # [f_lo, f_hi) the tiles every row sees whole (no mask needed). (Meaningless for a spare
    # block, which returns after the wait.)
    p_first = kv_len - q_len + qb * BLOCK_Q
    p_last = tl.minimum(p_first + BLOCK_Q - 1, kv_len - 1)
    n_lo = tl.maximum(p_first - window + 1, 0) // BLOCK_N
    n_hi = (p_last + BLOCK_N) // BLOCK_N
    f_lo = (tl.maximum(p_last - window + 1, 0) + BLOCK_N - 1) // BLOCK_N
    f_lo = tl.minimum(tl.maximum(f_lo, n_lo), n_hi)
    f_hi = tl.minimum(tl.maximum((p_first + 1) // BLOCK_N, f_lo), n_hi)
    if SPLIT:  # this program's share of the block's tiles; may be empty
        # At least min_split_tiles past SHORT_TILES (attention_plan's policy): the splits the
        # plan would give this real length, whatever bound it was planned for (the later
        # splits then hold nothing).
        least = tl.where(n_hi - n_lo > SHORT_TILES, min_split_tiles, 1)
        per = tl.maximum((n_hi - n_lo + num_splits - 1) // num_splits, least)
        used = tl.maximum((n_hi - n_lo + per - 1) // per, 1)  # splits holding a tile (>= 1)
        s_lo = n_lo + split * per
        s_hi = tl.minimum(s_lo + per, n_hi)
    else:
        s_lo = n_lo
        s_hi = n_hi
    enter(PDL)  # pdl.py: nothing above reads what a kernel in flight writes
    if qb * BLOCK_Q >= q_len:  # spare block of the grid bound (or an empty sequence)
        return
    if SPLIT:  # noqa: SIM102 - compile-time branches around a run-time one (Triton)
        # Nothing to attend and no partial anyone reads: the combine counts only the used
        # splits. A decode graph planned for a 32k bound launches 66 splits a kv head on the
        # H200 where a 1k context uses 8 to 16; with the empty ones storing partials and
        # joining the counter it took 11.7-12.2 us a layer against 10.2-10.5 (twenty-fifth
        # session).
        if COMBINE:  # noqa: SIM102
            if split >= used:
                return

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    tok = qb * BLOCK_Q + offs_m // HEADS  # [BLOCK_M] token index within the sequence
    g = (pid_h % HEAD_CHUNKS) * HEADS + offs_m % HEADS  # [BLOCK_M] head within the group
    row_ok = (tok < q_len) & (g < GROUP)  # padding rows compute on zeros and are never stored
    head = kvh * GROUP + g  # [BLOCK_M] query head
    pos = kv_len - q_len + tok  # [BLOCK_M] absolute position of the row's token
    lo_excl = pos - window  # [BLOCK_M] the row sees lo_excl < j <= pos
    row_t = (q_start + tok).to(tl.int64)  # [BLOCK_M] flat token index
    io_mask = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]

    # After the split's early exit: an empty split of a combining launch loads nothing.
    q = tl.load(
        q_ptr + row_t[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=io_mask,
        other=0.0,
    )  # [BLOCK_M, D_PAD]
    if UPCAST:
        q = q.to(tl.float32)

    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    # Finite start: a row masked in every tile of a split keeps m = -1e30 and l = 0 instead of
    # computing (-inf) - (-inf) = NaN; the combine kernel then gives that split zero weight.
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    pt_ptr = page_table_ptr + seq.to(tl.int64) * stride_pt
    k_base = k_ptr + kvh * stride_kh
    v_base = v_ptr + kvh * stride_kh
    # Three ranges, each clipped to this split: window's leading edge (masked), interior (no
    # mask), causal diagonal (masked).
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, k_base, v_base, pt_ptr, tl.maximum(n_lo, s_lo), tl.minimum(f_lo, s_hi),
        kv_len, pos, lo_excl, qk_scale, stride_kp, stride_ks,
        BLOCK_N, PAGE, HEAD_DIM, D_PAD, True, UPCAST, DOT_PRECISION,
    )  # fmt: skip
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, k_base, v_base, pt_ptr, tl.maximum(f_lo, s_lo), tl.minimum(f_hi, s_hi),
        kv_len, pos, lo_excl, qk_scale, stride_kp, stride_ks,
        BLOCK_N, PAGE, HEAD_DIM, D_PAD, False, UPCAST, DOT_PRECISION,
    )  # fmt: skip
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, k_base, v_base, pt_ptr, tl.maximum(f_hi, s_lo), tl.minimum(n_hi, s_hi),
        kv_len, pos, lo_excl, qk_scale, stride_kp, stride_ks,
        BLOCK_N, PAGE, HEAD_DIM, D_PAD, True, UPCAST, DOT_PRECISION,
    )  # fmt: skip

    if SPLIT:
        part = (row_t * num_q_heads + head) * num_splits + split  # [BLOCK_M] row of [T, Hq, NS]
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=io_mask)
        tl.store(part_m_ptr + part, m_i, mask=row_ok)
        tl.store(part_l_ptr + part, l_i, mask=row_ok)
        if COMBINE:  # the last of the block's splits to finish combines them (no 2nd launch)
            # The partials are ordered before the add (release); the last program's loads
            # after it (acquire, past L1) see every split's.
            counter = count_ptr + tl.program_id(0)
            if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == used - 1:
                tl.store(counter, 0)
                o_ptrs = out_ptr + row_t[:, None] * stride_ot + head[:, None] * stride_oh
                _combine_rows(
                    part_acc_ptr, part_m_ptr, part_l_ptr, (row_t * num_q_heads + head) * num_splits,
                    row_ok, used, o_ptrs + offs_d[None, :], io_mask,
                    BLOCK_M, HEAD_DIM, D_PAD, SPLITS_PAD, CHUNK,
                )  # fmt: skip
    else:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_ptrs = out_ptr + row_t[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=io_mask)


def paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    page_table: Tensor,
    cu_q_lens: Tensor,
    kv_lens: Tensor,
    scale: float,
    max_q_len: int,
    window: int = 0,
    out: Tensor | None = None,
    max_kv_len: int | None = None,
    counters: Tensor | None = None,
) -> Tensor:
    """Triton twin of `reference.paged_attention` (same contract); no host synchronisation.

    max_q_len must be >= every q_len (a smaller value leaves rows unwritten); max_kv_len bounds
    every kv_len for the split heuristic (default: page_table.shape[1] * S). counters:
    `new_counters`' buffer, the caller's own (launches that may run at once on other streams
    never share one): split launches then combine in their last programs.
    """
    return launch_paged_attention(
        q, k_cache, v_cache, page_table, cu_q_lens, kv_lens, scale, max_q_len, window, out,
        max_kv_len, counters=counters,
    )  # fmt: skip


def new_counters(device: torch.device) -> Tensor:
    """A call site's counters for combining splits in-kernel: [COUNTERS] int32 zeros, left at
    zero by every launch (a captured graph keeps the address)."""
    return torch.zeros(COUNTERS, dtype=torch.int32, device=device)


def launch_paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    page_table: Tensor,
    cu_q_lens: Tensor,
    kv_lens: Tensor,
    scale: float,
    max_q_len: int,
    window: int = 0,
    out: Tensor | None = None,
    max_kv_len: int | None = None,
    *,
    tiles: Tiles | None = None,
    num_splits: int | None = None,
    counters: Tensor | None = None,
) -> Tensor:
    """`paged_attention` with the tile shape and the split count exposed (tests, tuning)."""
    T, Hq, D = q.shape
    P, S, Hkv, Dk = k_cache.shape
    B, max_pages = page_table.shape
    assert Dk == D and v_cache.shape == k_cache.shape and Hq % Hkv == 0, (q.shape, k_cache.shape)
    assert k_cache.stride() == v_cache.stride(), "k_cache and v_cache must share one layout"
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1, "head dim must be contiguous"
    assert q.dtype == k_cache.dtype == v_cache.dtype, (q.dtype, k_cache.dtype, v_cache.dtype)
    assert cu_q_lens.shape == (B + 1,) and kv_lens.shape == (B,), (cu_q_lens.shape, kv_lens.shape)
    for name, t in (("page_table", page_table), ("cu_q_lens", cu_q_lens), ("kv_lens", kv_lens)):
        assert t.dtype == torch.int32 and t.is_contiguous(), f"{name}: contiguous int32 expected"
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(-1) == 1, (out.shape, q.shape)
    max_kv_len = max_pages * S if max_kv_len is None else max_kv_len
    plan = plan_launch(q.device, T, B, Hq, Hkv, D, max_q_len, max_kv_len, tiles, num_splits)
    if T == 0 or plan.q_blocks == 0:
        return out
    ns, split, d_pad = plan.num_splits, plan.num_splits > 1, max(16, triton.next_power_of_2(D))
    f32 = dict(device=q.device, dtype=torch.float32)
    part_acc = torch.empty((T, Hq, ns, D), **f32) if split else out  # unused unless split
    part_m = torch.empty((T, Hq, ns), **f32) if split else out
    part_l = torch.empty((T, Hq, ns), **f32) if split else out
    head_progs = Hkv * plan.head_chunks
    combine = split and counters is not None and counters.numel() >= plan.q_blocks * head_progs
    if combine:
        assert counters.dtype == torch.int32 and counters.device == q.device, counters
    _paged_attention_kernel[(plan.q_blocks * head_progs, ns)](
        q, k_cache, v_cache, out, part_acc, part_m, part_l, counters if combine else out,
        page_table, cu_q_lens, kv_lens,
        scale * _LOG2E, window if 0 < window < _NO_WINDOW else _NO_WINDOW, B, plan.q_blocks_per_seq,
        head_progs, ns, plan.min_split_tiles, Hq,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), page_table.stride(0),
        GROUP=Hq // Hkv, HEADS=plan.heads, HEAD_CHUNKS=plan.head_chunks,
        BLOCK_M=plan.tiles.block_m, BLOCK_Q=plan.block_q, BLOCK_N=plan.tiles.block_n, PAGE=S,
        HEAD_DIM=D, D_PAD=d_pad, DIRECT=plan.direct, SPLIT=split,
        # The interpreter's 16-bit arithmetic is unreliable (bf16 adds raw bits): compute in fp32
        # there. fp32 inputs on the GPU use full-precision dots instead of tf32.
        UPCAST=os.environ.get("TRITON_INTERPRET", "0") == "1",
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        COMBINE=combine, SPLITS_PAD=_SPLITS_PAD, CHUNK=COMBINE_CHUNK, SHORT_TILES=SHORT_TILES,
        num_warps=plan.tiles.num_warps, num_stages=plan.tiles.num_stages,
        **pdl_launch(q.device),
    )  # fmt: skip
    if split and not combine:
        # One variant for every split count: a constexpr that followed it (its next power of
        # two) compiled a new reduce kernel each time a growing context doubled the splits,
        # inside an agent's turn on the device. Masked loads of the unused splits cost nothing.
        _combine_splits_kernel[(T, Hq)](
            part_acc, part_m, part_l, out, ns, Hq, out.stride(0), out.stride(1),
            HEAD_DIM=D, D_PAD=d_pad, SPLITS_PAD=_SPLITS_PAD, CHUNK=SPLIT_CHUNK, num_warps=4,
            **pdl_launch(q.device),
        )  # fmt: skip
    return out
