"""Emptying a range of expert slots: the bottom of the usable range when the elastic split
shrinks the slots (`ExpertCache.resize`), the top of the arena when slots are lent to the
prefill streamer as staging (`ExpertCache.lend`).

The slots' twin of kv/vacate.py: the coldest residents are evicted until the rest fit outside
the range, and those still inside move to the lowest free slots outside it, one row copy a bank
(on the copy stream on CUDA, after queued compute). Both callers publish the moves themselves.
It lives apart from cache.py because it is the one place where a resident expert changes
slot; the fills' path never moves one.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

from freetoken_agent.engine.device_index import on_device
from freetoken_agent.kernels.row_copy import row_copy

if TYPE_CHECKING:
    from freetoken_agent.engine.experts.cache import ExpertCache


def vacate_slots(cache: ExpertCache, lo: int, hi: int, keep: int) -> tuple[list[int], list[int]]:
    """Empty slots lo..hi-1 (a shrink's bottom edge, a lend's top): evict the least
    recently used lids until `keep` remain, then move the residents of the range into the
    lowest free slots outside it. The free list keeps the free slots outside the range; the
    caller publishes the moves (and with them the evictions). Returns (evicted lids, moved
    lids)."""
    cache.vacates += 1
    evicted = cache.evict_coldest(len(cache._lru) - keep)
    free = sorted((slot for slot in cache._free if not lo <= slot < hi), reverse=True)
    stay = [(cache._lid_of[s], s) for s in range(lo, hi) if cache._lid_of[s] >= 0]
    pairs = [(lid, src, free.pop()) for lid, src in stay]  # into the lowest free slots
    if pairs:
        move_slots(cache, pairs)
    cache._free = free
    return evicted, [lid for lid, _, _ in pairs]


def move_slots(cache: ExpertCache, pairs: list[tuple[int, int, int]]) -> None:
    """(lid, from slot, to slot): copy the rows and update the host maps."""
    if cache.copy_stream is not None:
        cache.copy_stream.wait_stream(torch.cuda.current_stream(cache.device))
    with torch.cuda.stream(cache.copy_stream) if cache.copy_stream else contextlib.nullcontext():
        # One launch a bank: a shrink or a lend moves up to a group's worth of slots (a
        # copy each was two launches a slot). Sources and destinations never overlap.
        src_rows = on_device([src for _, src, _ in pairs], torch.long, cache.device)
        dst_rows = on_device([dst for _, _, dst in pairs], torch.long, cache.device)
        row_copy(cache.w13, cache.w13, dst_rows, src_rows)
        row_copy(cache.w2, cache.w2, dst_rows, src_rows)
    for lid, src, dst in pairs:
        cache._lid_of[src], cache._lid_of[dst] = -1, lid
        cache._slot_of[lid] = dst
