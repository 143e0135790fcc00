"""The GPU expert cache: a budget of slots, each holding every tensor of one (layer, expert).

Slots mirror the pool's banks (`w13 [S, 2I, H]`, `w2 [S, H, I]`), so a fill is one copy per bank
and the fused MoE kernels read slots exactly as they read a resident bank (rows = slot ids).
`slot_of [N]` maps lid -> slot (-1 when absent); it lives on the compute device for the kernels,
with a host mirror for the decisions. One LRU order spans all layers: an expert hot in layer 3
keeps its slot against a cold one in layer 40.

On a CPU "device" the slots are CPU tensors and a fill is a plain copy: the same cache, policy
and accounting code runs in CI. On CUDA, fills go on a dedicated copy stream and the compute
stream waits on an event recorded after them, so compute waits only for the slots it needs.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from freetoken_agent.engine.experts.pool import ExpertPool

# S slots, N = L * E lids, H hidden, I expert width

USEFUL_EMA = 0.02  # weight of the newest fill in the running fraction of useful fills


class ExpertCache:
    def __init__(self, pool: ExpertPool, n_slots: int, device: torch.device) -> None:
        if n_slots < 1:
            raise ValueError(f"the expert cache needs at least one slot, got {n_slots}")
        n_slots = min(n_slots, pool.n_rows)
        self.pool = pool
        self.device = device
        self.w13 = torch.empty((n_slots, *pool.w13.shape[1:]), dtype=pool.w13.dtype, device=device)
        self.w2 = torch.empty((n_slots, *pool.w2.shape[1:]), dtype=pool.w2.dtype, device=device)
        self.slot_of = torch.full((pool.n_rows,), -1, dtype=torch.int32, device=device)  # [N]
        self._slot_of: list[int] = [-1] * pool.n_rows  # host mirror
        self._lid_of: list[int] = [-1] * n_slots
        self._lru: OrderedDict[int, None] = OrderedDict()  # resident lids, least recent first
        self._free = list(range(n_slots - 1, -1, -1))
        self._pinned_set: frozenset[int] = frozenset()  # lids that are never evicted (static)
        self._lent = 0  # the last `_lent` slots are lent out as staging (lend / take_back)
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.hits = 0
        self.misses = 0
        self.fills = 0
        self.bytes_filled = 0
        self.fill_timings: list[tuple] = []  # (start, end, bytes) of fills, read by the bank
        # Did fills pay? A filled lid is "fresh" until its first hit; evicted fresh, it was
        # churn. `useful_fills` is the running fraction of fills hit before eviction.
        self._fresh: set[int] = set()
        self.useful_fills = 1.0

    @property
    def n_slots(self) -> int:
        return len(self._lid_of)

    @property
    def nbytes(self) -> int:
        return self.w13.nbytes + self.w2.nbytes

    def resident(self, lid: int) -> bool:
        return self._slot_of[lid] >= 0

    def touch(self, lids: list[int]) -> None:
        """Count hits and misses and move resident ones to the most-recent end of the LRU."""
        for lid in lids:
            if self._slot_of[lid] >= 0:
                self.hits += 1
                self._lru.move_to_end(lid)
                if lid in self._fresh:
                    self._fresh.discard(lid)
                    self.useful_fills += USEFUL_EMA * (1.0 - self.useful_fills)
            else:
                self.misses += 1

    def fill(
        self, lids: list[int], protect: set[int], after_compute: bool = True, publish: bool = True
    ) -> list[int]:
        """Bring `lids` (absent ones) into slots, evicting least-recently-used lids outside
        `protect` (the experts this layer is about to use). Returns the lids actually filled:
        fewer than asked when every slot is protected. `after_compute=False` lets the copies
        start at once: for callers whose queued compute is all discarded anyway (speculative
        graph segments, see segmented_graphs.py). `publish=False` leaves the device table to a
        later `publish(filled)`: publishing waits for the copies, so a caller with CPU work to
        overlap with them does that work first."""
        filled = []
        timing = None
        if self.copy_stream is not None and lids:
            # Victim slots may hold experts that queued compute still reads: the copies go
            # after it. The timing starts after that wait, so it measures the copies alone.
            if after_compute:
                self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            timing = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            timing[0].record(self.copy_stream)
        for lid in lids:
            if self._slot_of[lid] >= 0:
                continue
            slot = self._take_slot(protect)
            if slot is None:
                break
            self._copy_in(lid, slot)
            self._slot_of[lid] = slot
            self._lid_of[slot] = lid
            self._lru[lid] = None
            self._fresh.add(lid)
            filled.append(lid)
        if timing is not None:
            timing[1].record(self.copy_stream)
            self.fill_timings.append((*timing, len(filled) * self.pool.expert_bytes))
        if filled and publish:
            self.publish(filled)
        return filled

    def _take_slot(self, protect: set[int]) -> int | None:
        if self._free:
            return self._free.pop()
        for victim in self._lru:
            if victim not in protect and victim not in self._pinned_set:
                slot = self._slot_of[victim]
                self._evict(victim)
                return slot
        return None

    def _evict(self, lid: int) -> None:
        if lid in self._fresh:
            self._fresh.discard(lid)
            self.useful_fills += USEFUL_EMA * (0.0 - self.useful_fills)
        slot = self._slot_of[lid]
        del self._lru[lid]
        self._slot_of[lid] = -1
        self._lid_of[slot] = -1
        self.slot_of[lid] = -1

    def _copy_in(self, lid: int, slot: int) -> None:
        self.fills += 1
        self.bytes_filled += self.pool.expert_bytes
        if self.copy_stream is None:
            self.w13[slot].copy_(self.pool.w13[lid])
            self.w2[slot].copy_(self.pool.w2[lid])
            return
        with torch.cuda.stream(self.copy_stream):
            self.w13[slot].copy_(self.pool.w13[lid], non_blocking=self.pool.pinned)
            self.w2[slot].copy_(self.pool.w2[lid], non_blocking=self.pool.pinned)

    def publish(self, lids: list[int]) -> None:
        """Publish filled slots to the device table; compute waits for the copies. The table's
        host-to-device copy comes from pageable memory, which makes the host wait for the copy
        stream too."""
        if not lids:
            return
        idx = torch.tensor(lids, dtype=torch.long)
        val = torch.tensor([self._slot_of[lid] for lid in lids], dtype=torch.int32)
        if self.copy_stream is not None:
            with torch.cuda.stream(self.copy_stream):
                self.slot_of[idx.to(self.device)] = val.to(self.device)
            torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)
        else:
            self.slot_of[idx] = val

    def lend(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Take the last `n` slots out of service (evicting what they hold) and return them as
        scratch banks ([n, 2I, H], [n, H, I]): the prefill streamer stages whole layers there
        instead of in buffers of its own, so the budget holds more slots (see streaming.py).
        `take_back` returns them, empty."""
        if self._lent:
            raise RuntimeError("the expert cache's slots are already lent")
        if n > self.n_slots:
            raise ValueError(f"cannot lend {n} of {self.n_slots} slots")
        first = self.n_slots - n
        for slot in range(first, self.n_slots):
            lid = self._lid_of[slot]
            if lid >= 0:
                if lid in self._pinned_set:
                    raise RuntimeError(f"slot {slot} holds pinned expert {lid}")
                self._fresh.discard(lid)  # evicted for staging, not for another fill
                self._evict(lid)
        lent = set(range(first, self.n_slots))
        self._free = [slot for slot in self._free if slot not in lent]
        self._lent = n
        return self.w13[first:], self.w2[first:]

    def take_back(self) -> None:
        """The lent slots return to the free list (their content is scratch)."""
        first = self.n_slots - self._lent
        self._free.extend(range(self.n_slots - 1, first - 1, -1))
        self._lent = 0

    @property
    def lent(self) -> int:
        return self._lent

    def preload(self, lids: list[int], pin: bool = False) -> None:
        """Fill `lids` now (e.g. a static placement chosen at load); `pin` keeps them forever."""
        self.fill(lids, protect=set(lids))
        if pin:
            self._pinned_set = frozenset(lid for lid in lids if self._slot_of[lid] >= 0)

    def reset(self) -> None:
        """Empty every slot (benchmarks start each policy from the same state)."""
        self._fresh.clear()
        self.useful_fills = 1.0
        for lid in list(self._lru):
            slot = self._slot_of[lid]
            self._evict(lid)
            self._free.append(slot)
        self._pinned_set = frozenset()

    def clear_counters(self) -> None:
        self.hits = self.misses = self.fills = self.bytes_filled = 0

    def check_integrity(self) -> None:
        host = torch.tensor(self._slot_of, dtype=torch.int32)
        assert torch.equal(self.slot_of.cpu(), host), "device lid->slot table out of sync"
        seen = set()
        for lid, slot in enumerate(self._slot_of):
            if slot >= 0:
                assert self._lid_of[slot] == lid, f"slot {slot} maps back to {self._lid_of[slot]}"
                assert lid in self._lru, f"resident lid {lid} missing from the LRU"
                seen.add(slot)
        assert len(self._lru) == len(seen), "LRU holds lids without slots"
        assert not (seen & set(self._free)), "a used slot is on the free list"
        assert len(seen) + len(self._free) + self._lent == self.n_slots, "slots leaked"
        lent = range(self.n_slots - self._lent, self.n_slots)
        assert all(self._lid_of[slot] < 0 for slot in lent), "a lent slot holds an expert"
        assert not (set(lent) & set(self._free)), "a lent slot is on the free list"
        assert self._pinned_set <= set(self._lru), "a pinned lid is not resident"
