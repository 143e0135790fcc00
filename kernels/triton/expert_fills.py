"""The in-graph cache fill in Triton: a layer's plan (one program) and its copies (a few dozen
programs reading pinned host memory). Twin and state layout: `kernels/reference_fills.py`.

Plan. One program holds the layer's P <= 128 pairs: the first appearance of each lid (an
all-pairs compare), its slot, the hits' stamps, then the victims of all the layer's fills at
once. A victim's key is (stamp + 1) * S + slot, so the smallest key is the rule's smallest stamp
with ties to the lowest slot, and the f fills of a layer take the f smallest keys in order. The
stamps are read once, in chunks of up to SCAN_BLOCK_MAX held in registers: the first chunk gives
its f smallest (f min-reductions), a later chunk only its keys below the worst kept one (a cache
scanned in random stamp order replaces few). The kept keys, sorted when a later chunk broke
their order, give the fill of order q the q-th smallest (`tl.gather`), and the tables are
written in one vector pass. A layer that fills nothing scans nothing. (The plan before scanned
all S stamps once per miss, serially: on the H200, 1.4-1.7x slower from four misses at 687 and
3,022 slots, 2.4-4.2x at 18,000; `bench plan-kernel`, bench/results/NOTES.md, 35th session.)
Writes by some threads are read by others after `tl.debug_barrier` (one CTA). A scalar is
loaded by every thread and stored by one, so a state entry the plan updates (CLOCK, SEQ, the
counters) is read by all threads before the barrier that precedes its store: on the device a
warp that read SEQ after the store rang the worker's doorbell with the next number, and the
layer's wait never saw its answer. A [BLOCK_P] vector may be held by several threads at once,
so the fills' old owners are all read before the barrier that precedes the tables' stores.

Copies. A fixed grid (a captured graph cannot size it by the plan) walks the moves' chunks:
program g takes chunks g, g + PROGRAMS, ...; with no move every program exits at once. The
zero-copy probe (bench/zero_copy_probe.py) read pinned memory at 51 GB/s from 16 programs of
8192 elements, against 55 GB/s for cudaMemcpy; PROGRAMS is the host's own, timed by
`freetoken calibrate` (kernels/expert_fills.py COPY_PROGRAM_CHOICES). The CPU worker's answer
to the plan's post is waited for later, in the MoE sum over k (cpu_answer.py), so the copies
and the MoE kernels of the slots' experts run while the worker computes.
"""

# P pairs, S slots, M most moves; a bank row is n13 = 2I*H (w13) or n2 = H*I (w2) elements

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken_agent.kernels.cpu.worker import COL_HI, COL_LO, POST, TOKENS
from freetoken_agent.kernels.reference_fills import (
    CLOCK,
    CPU_ALL_MISSES,
    CPU_EXPERTS,
    CPU_SHARE,
    EXPERTS,
    FILLS,
    HITS,
    HOST_READS,
    LAYER_CPU,
    LIVE_PAIRS,
    MOVES,
    PAIRS,
    PARTIAL_HITS,
    PINNED,
    SEQ,
    SHARE_ONE,
    SPLIT_COLS,
    SPLITS,
    CpuPost,
    SplitTables,
)
from freetoken_agent.kernels.triton.cpu_answer import sys_ordering
from freetoken_agent.kernels.triton.host_sync import release_fence_sys, store_release_sys
from freetoken_agent.kernels.triton.pdl import enter
from freetoken_agent.kernels.triton.pdl import launch as pdl_launch

SCAN_BLOCK_MAX = 4096  # most stamps a scan chunk holds in registers (32 a thread at 4 warps)
COPY_BLOCK = 8192  # elements a copy program moves a step
COPY_COLUMNS = 128  # a split w2 tile's columns (its rows: COPY_BLOCK / COPY_COLUMNS)

_PINNED = tl.constexpr(PINNED)
_CLOCK, _MOVES = tl.constexpr(CLOCK), tl.constexpr(MOVES)
_HITS, _FILLS = tl.constexpr(HITS), tl.constexpr(FILLS)
_HOST_READS, _EXPERTS = tl.constexpr(HOST_READS), tl.constexpr(EXPERTS)
_PAIRS, _LIVE_PAIRS = tl.constexpr(PAIRS), tl.constexpr(LIVE_PAIRS)
_CPU_SHARE, _SEQ = tl.constexpr(CPU_SHARE), tl.constexpr(SEQ)
_CPU_ALL_MISSES = tl.constexpr(CPU_ALL_MISSES)
_LAYER_CPU, _CPU_EXPERTS = tl.constexpr(LAYER_CPU), tl.constexpr(CPU_EXPERTS)
_HALF = tl.constexpr(SHARE_ONE // 2)
_POST, _TOKENS = tl.constexpr(POST), tl.constexpr(TOKENS)
_SPLIT_COLS, _SPLITS = tl.constexpr(SPLIT_COLS), tl.constexpr(SPLITS)
_PARTIAL_HITS = tl.constexpr(PARTIAL_HITS)
_COL_LO, _COL_HI = tl.constexpr(COL_LO), tl.constexpr(COL_HI)
_NO_KEY = tl.constexpr(2**63 - 1)  # a slot no fill may take (keys: _smallest_keys)
BLOCK_H = 1024  # hidden elements a post step moves


@triton.jit
def _plan_kernel(
    ids_ptr, rows_ptr, slot_of, lid_of, stamp, state, moves, base, P, live_pairs, S,
    box_ctrl, box_rows, box_weights, box_hidden, hidden, weights, T, TH, uses,
    box_fills, cols, landed, width,
    LIMITED: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_S: tl.constexpr, SHARE: tl.constexpr,
    SYS: tl.constexpr, BLOCK_H: tl.constexpr, COUNT: tl.constexpr, THROUGH: tl.constexpr,
    SPLIT: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    enter(PDL)  # first: pdl.py
    offs = tl.arange(0, BLOCK_P)
    limit = live_pairs
    if LIMITED:  # a captured graph's padded rows: only the step's real pairs count
        limit = tl.minimum(tl.load(state + _LIVE_PAIRS), P).to(tl.int32)
    live = offs < limit
    lid = tl.load(ids_ptr + offs, mask=live, other=0).to(tl.int64) + base  # [BLOCK_P]
    same = (lid[:, None] == lid[None, :]) & live[None, :]  # [BLOCK_P, BLOCK_P] pairs of a lid
    earlier = same & (offs[None, :] < offs[:, None])
    first = live & (tl.sum(earlier.to(tl.int32), axis=1) == 0)
    used = offs * 0  # [BLOCK_P] each first appearance's uses before this plan (COUNT)
    if COUNT:  # one use for each distinct lid (first appearances: no two threads share one)
        used = tl.load(uses + lid, mask=first, other=0)
        tl.store(uses + lid, used + 1, mask=first)
    slot = tl.load(slot_of + lid, mask=live, other=-1)
    hit = first & (slot >= 0)
    miss = first & (slot < 0)
    clock = tl.load(state + _CLOCK) + 1
    seq = tl.load(state + _SEQ) + 1  # the next post's, read before any store (below)
    # Every thread holds what it read of the state before any thread writes it: a warp that
    # read CLOCK after another stored it would stamp with the next clock (see the module
    # docstring: scalars are read by every thread, stored by one).
    tl.debug_barrier()
    tl.store(state + _CLOCK, clock)
    old_stamp = tl.load(stamp + slot, mask=hit, other=_PINNED)
    tl.store(stamp + slot, tl.zeros_like(old_stamp) + clock, mask=hit & (old_stamp != _PINNED))
    partial = offs < 0  # [BLOCK_P] first appearances hitting a slot in flight (SPLIT)
    cut = clock * 0
    if SPLIT:  # a hit on a cut slot: whole once its copies behind landed, else posted again
        cut = tl.load(state + _SPLIT_COLS)
        held = tl.load(cols + slot, mask=hit, other=width)
        cut_hit = hit & (held < width)
        arrived = tl.load(landed + slot, mask=cut_hit, other=-1)
        tl.store(cols + slot, tl.zeros_like(held) + width, mask=cut_hit & (arrived == lid))
        partial = cut_hit & (arrived != lid)
    tl.debug_barrier()
    rank = tl.cumsum(miss.to(tl.int32), axis=0) - 1  # [BLOCK_P] a miss's order
    n_miss = tl.sum(miss.to(tl.int32), axis=0)
    share = clock * 0
    kept = n_miss * 0 + 1  # fills the layer keeps from the CPU's share
    if SHARE and not SPLIT:  # a split plan posts columns, never whole experts
        share = tl.load(state + _CPU_SHARE)
        kept = tl.where(tl.load(state + _CPU_ALL_MISSES) != 0, 0, 1)
    # At most all misses but one, the layer keeping a fill, unless CPU_ALL_MISSES lifts the
    # bound (reference_fills.py `cpu_misses`).
    n_cpu = tl.minimum(((n_miss * share + _HALF) >> 16).to(tl.int32), n_miss - kept)
    n_cpu = tl.maximum(n_cpu, 0)
    if COUNT and SHARE and not SPLIT:  # the n_cpu least used misses (ties: the earlier)
        key = used.to(tl.int64) * BLOCK_P + offs  # [BLOCK_P] distinct among the misses
        colder = miss[None, :] & (key[None, :] < key[:, None])  # [BLOCK_P, BLOCK_P]
        cpu_first = miss & (tl.sum(colder.to(tl.int32), axis=1) < n_cpu)
    else:  # miss r when round((r + 1) * share) > round(r * share), the first n_cpu of those
        cpu_before = (rank * share + _HALF) >> 16  # [BLOCK_P]
        cpu_first = miss & (((rank + 1) * share + _HALF) >> 16 > cpu_before)
        cpu_first = cpu_first & (cpu_before < n_cpu)
    fill_first = miss & ~cpu_first
    q = tl.cumsum(fill_first.to(tl.int32), axis=0) - 1  # [BLOCK_P] a fill's order among fills
    best, filled = _smallest_keys(stamp, lid_of, cols, landed, S, clock, width, n_miss - n_cpu,
                                  BLOCK_S, BLOCK_P, SPLIT)  # fmt: skip
    if filled > 0:  # the fill of order q takes the q-th smallest key
        got = fill_first & (q < filled)  # [BLOCK_P] first appearances that fill
        victim = tl.gather(best, tl.where(got, q, 0), 0) % S  # [BLOCK_P] their slots
        old = tl.load(lid_of + victim, mask=got, other=-1)
        tl.debug_barrier()  # every holder of a fill read its slot's old lid before any store
        tl.store(slot_of + old, -1, mask=got & (old >= 0))
        tl.store(lid_of + victim, lid.to(tl.int32), mask=got)
        tl.store(slot_of + lid, victim.to(tl.int32), mask=got)
        tl.store(stamp + victim, clock + victim * 0, mask=got)
        if SPLIT:  # the slot holds the columns [0, cut) until its copies behind land
            tl.store(cols + victim, cut.to(tl.int32) + victim.to(tl.int32) * 0, mask=got)
            tl.store(landed + victim, victim * 0 - 1, mask=got)
        tl.store(moves + 2 * q, lid, mask=got)
        tl.store(moves + 2 * q + 1, victim, mask=got)
        tl.debug_barrier()
    on_cpu = offs < 0  # [BLOCK_P] every pair of a lid the CPU takes (its first appearance's)
    if n_cpu > 0:
        on_cpu = live & (tl.sum((same & cpu_first[None, :]).to(tl.int32), axis=1) > 0)
    before = slot  # a lid without a slot before the plan and with one after: moved
    slot = tl.load(slot_of + lid, mask=live, other=-1).to(tl.int64)
    moved = live & (before < 0) & (slot >= 0)
    if THROUGH:  # a moved lid's pairs read it from the host, storing it into its slot
        slot = tl.where(moved, -1, slot)
    rows = tl.where(slot >= 0, slot, -lid - 2)
    tl.store(rows_ptr + offs, tl.where(live & ~on_cpu, rows, -1), mask=offs < P)
    n_part = tl.sum(partial.to(tl.int32), axis=0)
    n_post = n_cpu
    posted = on_cpu
    fill_slot = tl.zeros_like(slot) - 1  # [BLOCK_P] the slot a pair's columns go to behind
    if SPLIT:  # the split fills' and the in-flight hits' pairs (every pair of their lids)
        posted = moved | (live & (tl.sum((same & partial[None, :]).to(tl.int32), axis=1) > 0))
        n_post = filled + n_part
        fill_slot = tl.where(first & moved, slot, -1)
    n_hit = tl.sum(hit.to(tl.int64), axis=0)
    n_first = tl.sum(first.to(tl.int64), axis=0)
    hits, fills = tl.load(state + _HITS), tl.load(state + _FILLS)
    reads, experts = tl.load(state + _HOST_READS), tl.load(state + _EXPERTS)
    pairs, on_cpu_total = tl.load(state + _PAIRS), tl.load(state + _CPU_EXPERTS)
    splits, partials = tl.load(state + _SPLITS), tl.load(state + _PARTIAL_HITS)
    tl.debug_barrier()  # the counters read by every thread before one adds to them
    tl.store(state + _MOVES, filled.to(tl.int64))
    tl.store(state + _HITS, hits + n_hit)
    tl.store(state + _FILLS, fills + filled)
    tl.store(state + _HOST_READS, reads + n_miss - filled - n_cpu)
    tl.store(state + _EXPERTS, experts + n_first)
    tl.store(state + _PAIRS, pairs + limit)
    tl.store(state + _LAYER_CPU, n_post.to(tl.int64))
    tl.store(state + _CPU_EXPERTS, on_cpu_total + n_cpu)
    if SPLIT:
        tl.store(state + _SPLITS, splits + filled)
        tl.store(state + _PARTIAL_HITS, partials + n_part)
    if SHARE:  # noqa: SIM102 - a constexpr gate, then a runtime branch (Triton)
        if n_post > 0:  # the post: the job's data, a fence, then the doorbell
            tl.store(box_rows + offs, tl.where(posted, lid, -1), mask=offs < P)
            tl.store(box_fills + offs, fill_slot, mask=offs < P)
            if SPLIT:  # the job's columns of I: past the cut (0, 0: whole experts)
                tl.store(box_ctrl + _COL_LO, cut)
                tl.store(box_ctrl + _COL_HI, cut * 0 + width)
            else:
                tl.store(box_ctrl + _COL_LO, cut * 0)
                tl.store(box_ctrl + _COL_HI, cut * 0)
            w = tl.load(weights + offs, mask=offs < P, other=0.0)
            tl.store(box_weights + offs, w, mask=offs < P)
            offs_h = tl.arange(0, BLOCK_H)
            for h0 in range(0, TH, BLOCK_H):
                x = tl.load(hidden + h0 + offs_h, mask=h0 + offs_h < TH)
                tl.store(box_hidden + h0 + offs_h, x, mask=h0 + offs_h < TH)
            tl.store(box_ctrl + _TOKENS, tl.zeros((), tl.int64) + T)
            tl.store(state + _SEQ, seq)
            release_fence_sys(SYS)
            tl.debug_barrier()
            store_release_sys(box_ctrl + _POST, seq, SYS)


@triton.jit
def _smallest_keys(stamp, lid_of, cols, landed, S, clock, width, n_fill, BLOCK_S: tl.constexpr,
                   BLOCK_P: tl.constexpr, SPLIT: tl.constexpr):  # fmt: skip
    """The n_fill smallest keys (stamp + 1) * S + slot among the slots a fill may take (a
    stamp below the clock; SPLIT: no copies behind on their way), [BLOCK_P] ascending (then
    _NO_KEY), and how many there are (fewer when too few slots may be taken). Keys fit in
    int64 while clock * S < 2**63: 10**12 plans at a million slots."""
    offs_b = tl.arange(0, BLOCK_P)
    offs_s = tl.arange(0, BLOCK_S)
    best = tl.full([BLOCK_P], _NO_KEY, tl.int64)
    n_in = n_fill * 0
    worst = tl.where(n_fill > 0, clock * 0 + _NO_KEY, -1)  # what a key must be below to enter
    at = n_fill * 0  # where the worst kept key is, once n_fill are kept
    top, top_at = clock * 0 - 1, n_fill * 0  # the largest kept key and where, while filling
    shuffled = n_fill * 0  # the kept keys are out of order (in place of another, or smaller)
    end = tl.where(n_fill > 0, S, 0)  # a plan that fills nothing reads no stamp
    ahead = tl.load(stamp + offs_s, mask=offs_s < end, other=_PINNED)
    for s0 in range(0, end, BLOCK_S):
        slot = s0 + offs_s
        in_s = slot < S
        st = ahead
        # The next chunk's loads are issued before this one's reductions wait on them
        ahead = tl.load(stamp + BLOCK_S + slot, mask=BLOCK_S + slot < S, other=_PINNED)
        free = st < clock
        if SPLIT:  # a slot whose copies behind are on their way is no victim
            cut_s = tl.load(cols + slot, mask=in_s, other=width) < width
            came = tl.load(landed + slot, mask=in_s, other=-1)
            owner = tl.load(lid_of + slot, mask=in_s, other=-1).to(tl.int64)
            free = free & ~(cut_s & (came != owner))
        keys = tl.where(free, (st + 1) * S + slot, _NO_KEY)  # [BLOCK_S]
        v = tl.min(keys, axis=0)
        while v < worst:  # v enters: into the next free place, else the worst kept one's
            place = tl.where(n_in < n_fill, n_in, at)
            best = tl.where(offs_b == place, v, best)
            if n_in < n_fill:
                n_in += 1
                shuffled = shuffled | (v < top).to(tl.int32)  # a later chunk's smaller key
                top_at = tl.where(v > top, place, top_at)
                top = tl.maximum(top, v)
                if n_in == n_fill:
                    worst, at = top, top_at
            else:
                worst, at = tl.max(tl.where(offs_b < n_fill, best, -1), axis=0,
                                   return_indices=True)  # fmt: skip
                shuffled = shuffled | 1
            if v == worst:  # v is the largest kept and this chunk's others are larger (taken in
                v = worst  # order): none enters, so the loop ends here without another min
            else:
                keys = tl.where(keys == v, _NO_KEY, keys)
                v = tl.min(keys, axis=0)
    if shuffled != 0:  # else they entered in ascending order, each chunk's smallest first
        best = tl.sort(best)
    return best, n_in


@triton.jit
def _copy_kernel(
    state, moves, src13, src2, dst13, dst2, s_stride13, s_stride2, d_stride13, d_stride2, n13, n2,
    width, hidden_size,
    PROGRAMS: tl.constexpr, BLOCK: tl.constexpr, SPLIT: tl.constexpr, BLOCK_C: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    enter(PDL)  # first: pdl.py
    moved = tl.load(state + _MOVES)
    offs = tl.arange(0, BLOCK)
    if SPLIT:
        # The columns [0, cut) only, as contiguous runs the loads can vectorise (an element's
        # address computed by division, as a gather, compiled to 2-byte loads: 8x the load
        # instructions of a whole fill, and on the H200 a split layer's link half took about
        # twice its bytes' time). w13: the gate rows [0, cut) and the up rows [I, I + cut),
        # each cut * H contiguous elements; w2 [H, I]: tiles of BLOCK_R rows x BLOCK_C columns.
        cut = tl.load(state + _SPLIT_COLS).to(tl.int32)
        part = cut * hidden_size  # elements of each w13 half
        c13 = (part + BLOCK - 1) // BLOCK  # chunks of each half
        n_cb = (cut + BLOCK_C - 1) // BLOCK_C
        per = 2 * c13 + n_cb * ((hidden_size + BLOCK // BLOCK_C - 1) // (BLOCK // BLOCK_C))
        total = moved.to(tl.int32) * per
    else:
        c13 = (n13 + BLOCK - 1) // BLOCK
        per = c13 + (n2 + BLOCK - 1) // BLOCK  # chunks of one expert
        total = (moved * per).to(tl.int32)
    for w in range(tl.program_id(0), total, PROGRAMS):  # chunk `chunk` of move `move`
        move = w // per
        chunk = w % per
        lid = tl.load(moves + 2 * move)
        slot = tl.load(moves + 2 * move + 1)
        if SPLIT:
            if chunk < 2 * c13:
                half = chunk // c13  # 0: gate rows, 1: up rows (I rows on)
                at = (chunk - half * c13).to(tl.int64) * BLOCK + offs
                ok = at < part
                at += half.to(tl.int64) * n2  # I * H: where the up rows start
                val = tl.load(src13 + lid * s_stride13 + at, mask=ok)
                tl.store(dst13 + slot * d_stride13 + at, val, mask=ok)
            elif cut % 8 == 0:
                # Whole 16-byte runs: (cut // 8) * 8 is cut here, and the compiler knows it a
                # multiple of 8, so the masks vectorise (a tl.multiple_of hint on `cut` would
                # mark the value itself, in the other branch too).
                _copy_columns(src2 + lid * s_stride2, dst2 + slot * d_stride2, chunk - 2 * c13,
                              n_cb, (cut // 8) * 8, width, hidden_size, BLOCK,
                              BLOCK_C)  # fmt: skip
            else:
                _copy_columns(src2 + lid * s_stride2, dst2 + slot * d_stride2, chunk - 2 * c13,
                              n_cb, cut, width, hidden_size, BLOCK, BLOCK_C)  # fmt: skip
        elif chunk < c13:
            at = chunk.to(tl.int64) * BLOCK + offs
            ok = at < n13
            val = tl.load(src13 + lid * s_stride13 + at, mask=ok)
            tl.store(dst13 + slot * d_stride13 + at, val, mask=ok)
        else:
            at = (chunk - c13).to(tl.int64) * BLOCK + offs
            ok = at < n2
            val = tl.load(src2 + lid * s_stride2 + at, mask=ok)
            tl.store(dst2 + slot * d_stride2 + at, val, mask=ok)


@triton.jit
def _copy_columns(src, dst, tile, n_cb, cut, width, hidden_size, BLOCK: tl.constexpr,
                  BLOCK_C: tl.constexpr):  # fmt: skip
    """Tile `tile` of an expert's w2 [H, I] columns [0, cut): BLOCK // BLOCK_C rows x BLOCK_C
    columns, row-major over the tiles (src and dst at the expert's w2)."""
    block_r: tl.constexpr = BLOCK // BLOCK_C
    rows = (tile // n_cb) * block_r + tl.arange(0, block_r)  # [R]
    cols = (tile % n_cb) * BLOCK_C + tl.arange(0, BLOCK_C)  # [C]
    at = rows.to(tl.int64)[:, None] * width + cols[None, :]  # [R, C]
    ok = (rows < hidden_size)[:, None] & (cols < cut)[None, :]
    tl.store(dst + at, tl.load(src + at, mask=ok), mask=ok)


def plan_fills(
    ids, base, slot_of, lid_of, stamp, state, moves, live_pairs, post: CpuPost | None = None,
    uses: torch.Tensor | None = None, through: bool = False, split: SplitTables | None = None,
) -> torch.Tensor:  # fmt: skip
    """Twin of `reference_fills.plan_fills` (same contract); one launch, no host sync."""
    p = ids.numel()
    rows = torch.empty(p, dtype=torch.int64, device=ids.device)
    if p == 0:
        return rows
    limited = live_pairs is None
    live = p if limited else min(p, live_pairs)
    if post is None:
        box, t, th, fills = (state,) * 6, 0, 0, state  # unused pointers (SHARE is off)
    else:
        b = post.box
        box = (b.ctrl, b.rows, b.weights, b.hidden, post.hidden, post.weights)
        t, th, fills = post.hidden.shape[0], post.hidden.numel(), b.fill_slots
    tables = (split.cols, split.landed, split.width) if split is not None else (slot_of, stamp, 0)
    _plan_kernel[(1,)](
        ids, rows, slot_of, lid_of, stamp, state, moves, base, p, live, stamp.numel(), *box, t,
        th, uses if uses is not None else slot_of, fills, *tables, LIMITED=limited,
        BLOCK_P=max(16, triton.next_power_of_2(p)),
        BLOCK_S=min(SCAN_BLOCK_MAX, triton.next_power_of_2(stamp.numel())), SHARE=post is not None,
        SYS=sys_ordering(), BLOCK_H=BLOCK_H, COUNT=uses is not None, THROUGH=through,
        SPLIT=split is not None, num_warps=4,
        **pdl_launch(ids.device),
    )  # fmt: skip
    return rows


def copy_fills(state, moves, src_w13, src_w2, dst_w13, dst_w2, split: bool, programs: int) -> None:
    """Twin of `reference_fills.copy_fills`; a fixed grid of `programs`, no host sync."""
    _copy_kernel[(programs,)](
        state, moves, src_w13, src_w2, dst_w13, dst_w2, src_w13.stride(0), src_w2.stride(0),
        dst_w13.stride(0), dst_w2.stride(0), src_w13[0].numel(), src_w2[0].numel(),
        src_w2.shape[2], src_w2.shape[1],
        PROGRAMS=programs, BLOCK=COPY_BLOCK, SPLIT=split, BLOCK_C=COPY_COLUMNS,
        **pdl_launch(state.device),
    )  # fmt: skip
