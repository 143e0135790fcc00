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
"""

from __future__ import annotations

import torch
from torch import Tensor

# P pairs (T tokens x K), N lids, S slots, M most moves

PINNED = 1 << 62  # a stamp no clock reaches: the slot is never a victim
# state's entries
CLOCK, MOVES, HITS, FILLS, HOST_READS, EXPERTS, PAIRS, LIVE_PAIRS = range(8)
STATE = 8


def plan_fills(
    ids: Tensor,  # [P] int32/int64 expert ids within the layer
    base: int,  # the layer's first lid (layer * E)
    slot_of: Tensor,
    lid_of: Tensor,
    stamp: Tensor,
    state: Tensor,
    moves: Tensor,
    live_pairs: int | None = None,
) -> Tensor:
    """One layer's plan, in place on the state; returns rows [P] int64 for `fused_moe` with
    host banks: the slot of each pair's lid, its host id when it stayed absent, -1 for pairs
    at or past `live_pairs` (None: state[LIVE_PAIRS], a captured graph's padded rows)."""
    p = ids.numel()
    live = min(p, int(state[LIVE_PAIRS]) if live_pairs is None else live_pairs)
    lids = ids.reshape(-1)[:live].long() + base
    clock = int(state[CLOCK]) + 1
    state[CLOCK] = clock
    seen: dict[int, None] = {}
    for lid in lids.tolist():
        seen.setdefault(lid, None)
    uniq = list(seen)
    hits = [lid for lid in uniq if int(slot_of[lid]) >= 0]
    misses = [lid for lid in uniq if int(slot_of[lid]) < 0]
    for lid in hits:
        slot = int(slot_of[lid])
        if int(stamp[slot]) != PINNED:
            stamp[slot] = clock
    filled = 0
    for lid in misses:
        best = int(torch.argmin(stamp))  # the first of the smallest: the lowest slot
        if int(stamp[best]) >= clock:
            break  # every slot is this layer's or pinned: the rest are read from the host
        old = int(lid_of[best])
        if old >= 0:
            slot_of[old] = -1
        lid_of[best] = lid
        slot_of[lid] = best
        stamp[best] = clock
        moves[filled, 0], moves[filled, 1] = lid, best
        filled += 1
    state[MOVES] = filled
    state[HITS] += len(hits)
    state[FILLS] += filled
    state[HOST_READS] += len(misses) - filled
    state[EXPERTS] += len(uniq)
    state[PAIRS] += live
    rows = torch.full((p,), -1, dtype=torch.int64, device=ids.device)
    slots = slot_of[lids].long()
    rows[:live] = torch.where(slots >= 0, slots, -lids - 2)
    return rows


def copy_fills(
    state: Tensor, moves: Tensor, src_w13: Tensor, src_w2: Tensor, dst_w13: Tensor, dst_w2: Tensor
) -> None:
    """The last plan's moves: dst[slot] = src[lid] in both banks."""
    for lid, slot in moves[: int(state[MOVES])].tolist():
        dst_w13[slot].copy_(src_w13[lid])
        dst_w2[slot].copy_(src_w2[lid])
