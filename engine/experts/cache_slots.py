"""How the expert cache's slot range moves: staging lent to the prefill streamer (`lend`,
`take_back`) and the elastic split's edge (`resize`), both emptying a range of slots while
keeping the hottest experts (`_vacate`, `_move`). A mixin of ExpertCache (cache.py), whose
maps, LRU and free list these methods update.
"""

from __future__ import annotations

import contextlib

import torch

from freetoken_agent.engine.device_index import on_device
from freetoken_agent.kernels.row_copy import row_copy


class MovableSlots:
    def lend(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Take the last `n` slots out of service and return them as scratch banks
        ([n, 2I, H], [n, H, I], contiguous even on the arena: `scratch_banks`): the prefill
        streamer stages whole layers there instead of in buffers of its own, so the budget
        holds more slots (see streaming.py). `take_back` returns them, empty.

        The cache keeps its hottest experts: the n coldest unpinned residents are evicted
        (wherever they live) and the survivors in the lent slots move into the slots that
        frees, one row copy a bank after queued compute, as `resize` does. Evicting whatever
        the top slots held had thrown out the experts filled last: after a lend, fills take the
        lowest free slot, which is the lent range's, so every prefill chunk evicted the
        previous decode's freshest fills."""
        if self._lent:
            raise RuntimeError("the expert cache's slots are already lent")
        self.inflight.settle()
        if n > self.n_slots:
            raise ValueError(f"cannot lend {n} of {self.n_slots} slots")
        room = self.n_slots - n  # slots that stay in service
        if len(self._pinned_set) > room:
            raise RuntimeError(f"cannot lend {n} slots: {len(self._pinned_set)} experts pinned")
        first = self.max_slots - n  # the top of the arena: resize moves only the bottom edge
        evicted, moved = self._vacate(first, self.max_slots, room)
        self._lent = n
        self._unpublished += evicted
        self.publish(moved)
        if self.arena is not None:  # its slot views are strided: staging wants plain DMA
            return self.arena.scratch_banks(first, n)
        return self.w13[first:], self.w2[first:]

    def take_back(self) -> None:
        """The lent slots return to the free list (their content is scratch)."""
        first = self.max_slots - self._lent
        self._free.extend(range(self.max_slots - 1, first - 1, -1))
        self._lent = 0

    @property
    def lent(self) -> int:
        return self._lent

    # --- the elastic split (engine/arena.py; the MemoryManager decides, at safe points) -----
    def resize(self, first_slot: int) -> list[int]:
        """Make slots first_slot .. S_max-1 the usable ones. Growing (a lower first_slot) adds
        free slots. Shrinking evicts the coldest resident lids in LRU order (never pinned ones)
        until the residents fit, then moves each lid still below the new first_slot into a free
        kept slot: a device copy of its rows on the copy stream, after queued compute (which
        may read the old slot), as fills are. The table is published like a fill's, so compute
        queued afterwards sees the new slots, and writes into the vacated slots (KV, on the
        compute stream) come after the copies. Returns the evicted lids.

        Races whose filled lid is evicted here are dropped: a memory-manager eviction says
        nothing about whether that fill paid. Races with it as victim settle as usual (it is
        absent, as it was)."""
        assert not self._lent, "resize while cache slots are lent out"
        self.inflight.settle()
        if not 0 <= first_slot < self.max_slots:
            raise ValueError(f"first_slot {first_slot} outside [0, {self.max_slots})")
        old = self.first_slot
        if first_slot <= old:
            self._free = sorted(set(self._free) | set(range(first_slot, old)), reverse=True)
            self.first_slot = first_slot
            return []
        keep = self.max_slots - first_slot
        if len(self._pinned_set) > keep:
            raise RuntimeError(
                f"cannot shrink the expert cache to {keep} slots: {len(self._pinned_set)} pinned"
            )
        evicted, moved = self._vacate(old, first_slot, keep)
        self.first_slot = first_slot
        self._unpublished += evicted
        self.publish(moved)
        return evicted

    def _vacate(self, lo: int, hi: int, keep: int) -> tuple[list[int], list[int]]:
        """Empty slots lo..hi-1 (a shrink's bottom edge, a lend's top): evict the least
        recently used unpinned lids until `keep` remain (the caller checked the pinned ones
        fit), then move the residents of the range into the lowest free slots outside it. The
        free list keeps the free slots outside the range; the table is the caller's to publish.
        Returns (evicted lids, moved lids)."""
        evicted, excess = [], len(self._lru) - keep
        for lid in list(self._lru):  # coldest first
            if excess <= 0:
                break
            if lid not in self._pinned_set:
                self._free.append(self._slot_of[lid])
                self._evict(lid)
                evicted.append(lid)
                excess -= 1
        self.races.drop(set(evicted))
        free = sorted((slot for slot in self._free if not lo <= slot < hi), reverse=True)
        stay = [(self._lid_of[s], s) for s in range(lo, hi) if self._lid_of[s] >= 0]
        pairs = [(lid, src, free.pop()) for lid, src in stay]  # into the lowest free slots
        if pairs:
            self._move(pairs)
        self._free = free
        return evicted, [lid for lid, _, _ in pairs]

    def _move(self, pairs: list[tuple[int, int, int]]) -> None:
        """(lid, from slot, to slot): copy the rows and update the host maps."""
        if self.copy_stream is not None:
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copy_stream) if self.copy_stream else contextlib.nullcontext():
            # One launch a bank: a shrink or a lend moves up to a group's worth of slots (a
            # copy each was two launches a slot). Sources and destinations never overlap.
            src_rows = on_device([src for _, src, _ in pairs], torch.long, self.device)
            dst_rows = on_device([dst for _, _, dst in pairs], torch.long, self.device)
            row_copy(self.w13, self.w13, dst_rows, src_rows)
            row_copy(self.w2, self.w2, dst_rows, src_rows)
        for lid, src, dst in pairs:
            self._lid_of[src], self._lid_of[dst] = -1, lid
            self._slot_of[lid] = dst
