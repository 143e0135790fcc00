"""Plain-torch twin of the in-graph cache fill (kernels/triton/expert_fills.py): test oracle and
the CPU path. The dispatcher is `kernels/expert_fills.py`; its docstring has the contract.

The state lives in tensors on the compute device (engine/experts/device_fills.py owns them):

    slot_of [N] int32   lid -> slot, -1 when absent (the cache's table, read by the MoE kernels)
    lid_of  [S] int32   slot -> lid, -1 when empty
    stamp   [S] int64   the clock when the slot was last used; -1 when free; PINNED: never a
                        victim (slots in KV's part of the arena, lent ones, kept layers')
    state   [STATE] int64   the clock, the moves of the last plan, counters (indexes below)
    moves   [M, 2] int64    (lid, slot) of each fill the last plan made, the first state[MOVES]

One plan is one MoE layer's visit: the clock advances; each distinct lid the layer routes to
that has a slot is a hit and takes the new clock as its stamp (PINNED stamps stay); each
miss, in order of first appearance, takes the slot of smallest stamp below the new clock
(ties: the lowest slot), evicting its lid. A miss left with no such slot (every slot is used
by this layer or pinned) is read from the host bank by the MoE kernels (`host_ids`).

The CPU's share (`post` given, state[CPU_SHARE] > 0): of a layer's m misses the CPU takes
round(m * share), share in 1/SHARE_ONE, but at most m - 1 unless state[CPU_ALL_MISSES] (below):
at least one fills (a lone miss always does). Which ones: with `uses` (the popularity counts),
the least used (ties: the earlier); without, miss r (in order) when round((r + 1) * share) >
round(r * share), spread evenly, the first m - 1 of those at most. A miss the CPU computes is
not cached, so the layer keeps a fill and the CPU takes the coldest: under skewed routing the
cache keeps learning its popular experts while the CPU shortens the layers that miss several.
Without the bound, a replay at shares of 0.8-0.9 (the share trials can reach them) sent both
misses of two-miss layers to the CPU and ran 32-44% slower at b=1 (`bench share-rule`, 48
layers, Zipf). On the H200 (48 layers / 32 GB, Zipf 1.0 / locality 0.7, the share held on
adaptive's shared path, at shares below 0.75, where the bound changes nothing): b=4 227.9 tok/s
against 179.1 filling every miss, b=1 124.4 against 130.7; the old rule (q*'s share of every
layer's misses, in order) ran b=1 at 77.8 against 111.3 (bench/results/NOTES.md, twenty-third
and thirty-sixth sessions). The bound is for the cache's sake, so it goes where fills do not
pay (state[CPU_ALL_MISSES] = 1: adaptive's fill race judged and out of `all`, near-uniform
routing, and no slot free): there a fill is evicted before its expert comes back, and the one
fill the bound keeps sets the layer's pace where the link's copy is slower than the CPU
(engine/experts/device_path.py `_set_share`). Its pairs get row -1 (the MoE kernels skip them);
the plan posts them to the CPU worker's mailbox (kernels/cpu/worker.py: the hidden rows, the
pairs' pool rows and weights, then POST = the next SEQ), and the MoE sum over k waits for the
answer (`wait_cpu`, after the copies and the MoE kernels: CpuAnswer) and adds it. They take no
slot: the link keeps its share's worth of fills.

The split expert (`split` given, state[SPLIT_COLS] = c in (0, I)): every fill is cut at column
c of the width I (SwiGLU is elementwise over I, so the two parts' outputs add). The copy moves
columns [0, c) only (gate rows [0, c), up rows [I, I + c), w2's columns [0, c)) and the slot's
`cols` becomes c; the CPU worker computes columns [c, I) of it in the same layer, and then copies
them into the slot behind the step with the copy engines and writes `landed[slot] = lid`
(kernels/cpu/worker.py: the post's `fill_slots`). Until then the slot is in flight: never a
victim, and a hit on it posts its columns [c, I) to the CPU again; a hit that finds it landed
makes it whole (`cols` = I). The MoE kernels read `cols` (fused_moe's slot_cols), which only
the plans write, so a layer's plan and its MoE kernels agree on each slot's columns whatever the
copies behind do meanwhile. No CPU share here: a split plan sends the CPU columns, not experts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor

from freetoken_agent.kernels.cpu.worker import (
    ANSWER,
    BEHIND,
    COL_HI,
    COL_LO,
    LOST,
    POST,
    TIMEOUT,
    TIMEOUT_S,
    TOKENS,
    Mailbox,
)

# P pairs (T tokens x K), N lids, S slots, M most moves

PINNED = 1 << 62  # a stamp no clock reaches: the slot is never a victim
# state's entries. CPU_SHARE, SEQ and the counters outlive a hand-back (DeviceFills.own);
# LAYER_CPU is the last plan's CPU experts, which the wait reads.
CLOCK, MOVES, HITS, FILLS, HOST_READS, EXPERTS, PAIRS, LIVE_PAIRS = range(8)
CPU_SHARE, SEQ, LAYER_CPU, CPU_EXPERTS = range(8, 12)
# The split expert: the cut column c (0: off; outlives a hand-back as CPU_SHARE does), then the
# counters of split fills and of hits on slots still in flight (each posted to the CPU).
SPLIT_COLS, SPLITS, PARTIAL_HITS = range(12, 15)
# 1: the CPU's share may take every miss of a layer (no fill kept: fills do not pay); 0: at
# most all but one. Written with CPU_SHARE, and outlives a hand-back as it does.
CPU_ALL_MISSES = 15
STATE = 16
SHARE_ONE = 1 << 16  # CPU_SHARE's fixed point: SHARE_ONE sends every miss to the CPU


@dataclass(slots=True)
class SplitTables:
    """The split expert's tables beside the cache's (engine/experts/device_fills.py owns them):
    cols [S] int32, the columns [0, cols) of I each slot holds (I: whole), written by the plans
    only; landed [S] int64, the lid whose columns past its cut the CPU worker's copies behind
    last landed in the slot (-1: none yet)."""

    cols: Tensor  # [S] int32
    landed: Tensor  # [S] int64
    width: int  # I

    def in_flight(self, lid_of: Tensor) -> Tensor:
        """[S] bool: slots holding part of their expert whose other part has not landed."""
        return (self.cols < self.width) & (self.landed != lid_of.long())


def cpu_count(n: int, share: int) -> int:
    """Of n misses, how many the CPU takes at `share` (round(n * share / SHARE_ONE))."""
    return (n * share + SHARE_ONE // 2) >> 16


def cpu_misses(misses: list[int], share: int, uses: Tensor | None,
               all_misses: bool = False) -> list[int]:  # fmt: skip
    """The misses (lids, in order of first appearance) the CPU takes at `share`: cpu_count of
    them but at most all but one (`all_misses`: all of them may go), the least used by `uses`
    (ties: the earlier), or without `uses` spread evenly by order, the first of those (module
    docstring)."""
    m = len(misses)
    n = min(cpu_count(m, share), m if all_misses else m - 1)
    if n <= 0:
        return []
    if uses is None:
        return [lid for r, lid in enumerate(misses)
                if cpu_count(r + 1, share) > cpu_count(r, share)][:n]  # fmt: skip
    coldest = sorted(range(m), key=lambda r: (int(uses[misses[r]]), r))[:n]
    return [misses[r] for r in sorted(coldest)]


@dataclass(slots=True)
class CpuPost:
    """What a plan posts to the CPU worker besides its pairs' rows: the layer's input and
    routing weights, and the mailbox (kernels/cpu/worker.py)."""

    box: Mailbox
    hidden: Tensor  # [T, H]
    weights: Tensor  # [T, K] fp32


@dataclass(slots=True)
class CpuAnswer:
    """Where a layer collects the CPU worker's answer to its plan's post: the MoE sum over k
    (`fused_moe(collect=...)`) waits for it and adds it before its one rounding, after the
    fill copies and the MoE kernels of the slots' experts (kernels/triton/cpu_answer.py).
    `behind` (a split plan): the twin also waits for the worker's copies behind (`wait_cpu`)."""

    state: Tensor  # [STATE] int64
    box: Mailbox
    timeout_s: float = TIMEOUT_S
    behind: bool = False


def plan_fills(
    ids: Tensor,  # [P] int32/int64 expert ids within the layer
    base: int,  # the layer's first lid (layer * E)
    slot_of: Tensor,
    lid_of: Tensor,
    stamp: Tensor,
    state: Tensor,
    moves: Tensor,
    live_pairs: int | None = None,
    post: CpuPost | None = None,
    uses: Tensor | None = None,
    through: bool = False,
    split: SplitTables | None = None,
) -> Tensor:
    """One layer's plan, in place on the state; returns rows [P] int64 for `fused_moe` with
    host banks: the slot of each pair's lid, its host id when it stayed absent, -1 for pairs
    at or past `live_pairs` (None: state[LIVE_PAIRS], a captured graph's padded rows) and for
    the CPU's share (posted to `post.box`). `uses` [N] int32: each distinct lid the layer
    routes to counts one use (engine/experts/popular_pins.py reads them). `through`
    (fill-through): a lid this plan moved keeps its host id in the rows, so the MoE kernels
    read it from the host and store it into its new slot as they go (no `copy_fills`
    follows: the moves stay listed for the counters and the tests). `split` (with `post`):
    the split expert (module docstring); its pairs keep their slots in the rows."""
    p = ids.numel()
    live = min(p, int(state[LIVE_PAIRS]) if live_pairs is None else live_pairs)
    lids = ids.reshape(-1)[:live].long() + base
    clock = int(state[CLOCK]) + 1
    state[CLOCK] = clock
    seen: dict[int, None] = {}
    for lid in lids.tolist():
        seen.setdefault(lid, None)
    uniq = list(seen)
    if uses is not None and uniq:
        uses[torch.tensor(uniq, dtype=torch.int64, device=uses.device)] += 1
    hits = [lid for lid in uniq if int(slot_of[lid]) >= 0]
    misses = [lid for lid in uniq if int(slot_of[lid]) < 0]
    cut = int(state[SPLIT_COLS]) if split is not None and post is not None else 0
    partial: list[int] = []  # hits on slots in flight: their columns past the cut to the CPU
    for lid in hits:
        slot = int(slot_of[lid])
        if int(stamp[slot]) != PINNED:
            stamp[slot] = clock
        if cut and int(split.cols[slot]) < split.width:
            if int(split.landed[slot]) == lid:
                split.cols[slot] = split.width  # its copies behind landed: whole
            else:
                partial.append(lid)
    share = int(state[CPU_SHARE]) if post is not None and split is None else 0
    on_cpu = cpu_misses(misses, share, uses, bool(state[CPU_ALL_MISSES]))
    # Slots whose copies behind are still on their way are never victims (they would land on
    # the new expert's rows).
    busy = split.in_flight(lid_of) if cut else None
    filled = 0
    for lid in misses:
        if lid in on_cpu:
            continue
        free = stamp if busy is None else torch.where(busy, PINNED, stamp)
        best = int(torch.argmin(free))  # the first of the smallest: the lowest slot
        if int(free[best]) >= clock:
            break  # every slot is this layer's or pinned: the rest are read from the host
        old = int(lid_of[best])
        if old >= 0:
            slot_of[old] = -1
        lid_of[best] = lid
        slot_of[lid] = best
        stamp[best] = clock
        if cut:
            split.cols[best], split.landed[best] = cut, -1
            busy = split.in_flight(lid_of)
        moves[filled, 0], moves[filled, 1] = lid, best
        filled += 1
    split_fills = [int(lid) for lid in moves[:filled, 0].tolist()] if cut else []
    state[MOVES] = filled
    state[HITS] += len(hits)
    state[FILLS] += filled
    state[HOST_READS] += len(misses) - filled - len(on_cpu)
    state[EXPERTS] += len(uniq)
    state[PAIRS] += live
    state[LAYER_CPU] = len(on_cpu) + len(split_fills) + len(partial)
    state[CPU_EXPERTS] += len(on_cpu)
    state[SPLITS] += len(split_fills)
    state[PARTIAL_HITS] += len(partial)
    rows = torch.full((p,), -1, dtype=torch.int64, device=ids.device)
    slots = slot_of[lids].long()
    if through and filled:
        moved = torch.isin(lids, moves[:filled, 0].to(lids.device))
        slots = torch.where(moved, -1, slots)
    rows[:live] = torch.where(slots >= 0, slots, -lids - 2)
    if on_cpu:
        cpu = torch.isin(lids, torch.tensor(on_cpu, dtype=torch.int64, device=lids.device))
        rows[:live][cpu] = -1
        _post(post, state, torch.where(cpu, lids, -1), p, None, (0, 0))
    elif split_fills or partial:
        to_cpu = torch.tensor(split_fills + partial, dtype=torch.int64, device=lids.device)
        cpu = torch.isin(lids, to_cpu)
        # The copies behind: one pair per split fill names its slot (its first).
        fill_slots = torch.full_like(lids, -1)
        for lid in split_fills:
            fill_slots[int((lids == lid).nonzero()[0])] = int(slot_of[lid])
        _post(post, state, torch.where(cpu, lids, -1), p, fill_slots, (cut, split.width))
    return rows


def _post(post: CpuPost, state: Tensor, cpu_rows: Tensor, p: int, fill_slots: Tensor | None,
          columns: tuple[int, int]) -> None:  # fmt: skip
    """The CPU's share into the mailbox, then its sequence number (the worker's doorbell).
    `fill_slots` [live]: the slot each pair's columns go to behind (None: none); `columns`:
    the job's (COL_LO, COL_HI), (0, 0) for whole experts."""
    box, t = post.box, post.hidden.shape[0]
    box.rows[:p].fill_(-1)
    box.rows[: cpu_rows.numel()].copy_(cpu_rows)
    box.fill_slots[:p].fill_(-1)
    if fill_slots is not None:
        box.fill_slots[: fill_slots.numel()].copy_(fill_slots)
    box.weights[:p].copy_(post.weights.reshape(-1))
    box.hidden[:t].copy_(post.hidden)
    box.ctrl[TOKENS] = t
    box.ctrl[COL_LO], box.ctrl[COL_HI] = columns
    seq = int(state[SEQ]) + 1
    state[SEQ] = seq
    box.ctrl[POST] = seq


def wait_cpu(state: Tensor, box: Mailbox, add: Tensor, timeout_s: float = TIMEOUT_S,
             behind: bool = False) -> None:  # fmt: skip
    """After the last plan posted: wait for the worker's answer and put it in `add` [T, H]
    (the MoE kernels' buffer, zero between layers; fp32 in the bank: the part is added before
    the layer's one rounding, as the resident sum is). A wait that outlives `timeout_s` marks
    the mailbox (ctrl[TIMEOUT]) and leaves `add` zero; a marked mailbox is not waited on
    again. Every wait that gives up writes its seq to ctrl[LOST]. `behind` (a split plan):
    also wait until the worker has made its copies behind (on the CPU they are plain copies,
    so the next plan finds them landed: the twin is deterministic where the device is not)."""
    if int(state[LAYER_CPU]) == 0:
        return
    seq = int(state[SEQ])
    end = time.monotonic() + timeout_s
    answered = BEHIND if behind else ANSWER
    while int(box.ctrl[answered]) != seq:
        if int(box.ctrl[TIMEOUT]) == 0 and time.monotonic() > end:
            box.ctrl[TIMEOUT] = seq
        if int(box.ctrl[TIMEOUT]) != 0:
            box.ctrl[LOST] = seq
            return
        time.sleep(0)
    t = add.shape[0]
    add.copy_(box.out[:t].to(add.device, add.dtype))


def copy_fills(
    state: Tensor,
    moves: Tensor,
    src_w13: Tensor,
    src_w2: Tensor,
    dst_w13: Tensor,
    dst_w2: Tensor,
    split: bool = False,
) -> None:
    """The last plan's moves: dst[slot] = src[lid] in both banks; with `split`, only the
    columns [0, state[SPLIT_COLS]) of I (gate rows, up rows, w2's columns)."""
    i = src_w2.shape[2]
    cut = int(state[SPLIT_COLS]) if split else i
    for lid, slot in moves[: int(state[MOVES])].tolist():
        dst_w13[slot, :cut].copy_(src_w13[lid, :cut])
        dst_w13[slot, i : i + cut].copy_(src_w13[lid, i : i + cut])
        dst_w2[slot, :, :cut].copy_(src_w2[lid, :, :cut])
