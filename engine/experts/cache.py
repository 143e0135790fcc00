"""The GPU expert cache: a budget of slots, each holding every tensor of one (layer, expert).

Slots mirror the pool's banks (`w13 [S, 2I, H]`, `w2 [S, H, I]`), so a fill is one copy per bank
and the fused MoE kernels read slots exactly as they read a resident bank (rows = slot ids).
`slot_of [N]` maps lid -> slot (-1 when absent); it lives on the compute device for the kernels,
with a host mirror for the decisions. One LRU order spans all layers: an expert hot in layer 3
keeps its slot against a cold one in layer 40.

On a CPU "device" the slots are CPU tensors and a fill is a plain copy: the same cache, policy
and accounting code runs in CI. On CUDA, fills go on a dedicated copy stream and the compute
stream waits on an event recorded after them, so compute waits only for the slots it needs.

On the elastic arena (engine/arena.py) `w13`/`w2` are the arena's views over every slot
position ([S_max, 2I, H] / [S_max, H, I], rows strided: a slot's w13 and w2 rows are adjacent)
and slot ids are absolute: the usable ones are first_slot .. S_max-1, the slots below belong to
KV. `resize(first_slot)` moves that edge at a safe point; the fused kernels index rows by
stride, so no pointer changes. `lend` always lends the top of the arena.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from freetoken_agent.engine.experts.device_fills import DeviceFills
from freetoken_agent.engine.experts.fill_races import FillRaces
from freetoken_agent.engine.experts.hit_clock import HitClock
from freetoken_agent.engine.experts.inflight import InflightFills
from freetoken_agent.engine.experts.pool import ExpertPool
from freetoken_agent.engine.experts.slot_banks import scratch_banks, slot_banks
from freetoken_agent.engine.experts.slot_table import SlotTable
from freetoken_agent.engine.experts.vacate import vacate_slots
from freetoken_agent.engine.experts.victims import coldest, lru_victim, prefill_victims
from freetoken_agent.kernels.fused_moe import PATH_LIMITS

if TYPE_CHECKING:
    from freetoken_agent.engine.arena import ElasticArena

# S slots, N = L * E lids, H hidden, I expert width


class ExpertCache:
    def __init__(
        self,
        pool: ExpertPool,
        n_slots: int,
        device: torch.device,
        lids_per_layer: int | None = None,
        arena: ElasticArena | None = None,
    ) -> None:
        """Standalone: `n_slots` slots of its own. On `arena`: the arena's slot views, usable
        from `arena.first_slot` (`n_slots` is ignored; at least one slot is required)."""
        self.pool = pool
        self.device = device
        self.arena = arena
        # [S, 2I, H], [S, H, I]: the cache's own, or the arena's strided views (slot_banks.py)
        self.w13, self.w2, self.first_slot = slot_banks(pool, n_slots, device, arena)
        self.max_slots = self.w13.shape[0]
        self._slot_of: list[int] = [-1] * pool.n_rows  # host mirror
        self._lid_of: list[int] = [-1] * self.max_slots
        self._lru: OrderedDict[int, None] = OrderedDict()  # resident lids, least recent first
        self._free = list(range(self.max_slots - 1, self.first_slot - 1, -1))  # pop: lowest
        # For the memory manager: the step of each lid's last hit (hit_clock.py).
        self.clock = HitClock(pool.n_rows)
        # Layers whose experts fills never evict (adaptive's `layers` mode and `static`,
        # layer_layout.py); a lend or a shrink may (`vacates` counts those).
        self.kept_layers: frozenset[int] = frozenset()
        self.vacates = 0
        self._lent = 0  # the last `_lent` slots are lent out as staging (lend / take_back)
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # The device's lid -> slot table, written from the host mirror (slot_table.py).
        self.table = SlotTable(self._slot_of, device, self.copy_stream)
        self.slot_of = self.table.slot_of  # [N], what the kernels read
        self.hits = 0
        self.misses = 0
        self.fills = 0
        self.bytes_filled = 0
        self.fill_timings: list[tuple] = []  # (start, end, bytes) of fills, read by the bank
        # Do fills pay? (fill_races.py; `touch` is one layer's visit)
        self.lids_per_layer = lids_per_layer or pool.n_rows
        self.races = FillRaces(self.lids_per_layer)
        # Fills that land while later steps run (policy direct; inflight.py).
        self.inflight = InflightFills(self)
        # Fills the decode graph makes itself (policy gpu-fill; device_fills.py). While the
        # device owns the cache the host mirror is stale: every method that reads or changes
        # it calls `_host` first.
        self.on_device = DeviceFills(self, PATH_LIMITS["decode_max_pairs"])

    def _host(self) -> None:
        """The host mirror made the truth again (a no-op unless policy gpu-fill's decode
        owns the cache: then one sync)."""
        self.on_device.release()

    @property
    def n_slots(self) -> int:
        return self.max_slots - self.first_slot

    @property
    def n_resident(self) -> int:
        """Experts in slots now."""
        self._host()
        return len(self._lru)

    @property
    def free_slots(self) -> int:
        self._host()
        return len(self._free)

    @property
    def free_slots_seen(self) -> int:
        """Free slots as the host mirror last saw them, with no sync: while the device owns
        the cache its plans only fill slots, never free one, so the count is an upper bound."""
        return len(self._free)

    @property
    def nbytes(self) -> int:
        return self.n_slots * self.pool.expert_bytes

    @property
    def fill_gain(self) -> float:
        """The running mean of fills' races against their victims (fill_races.py)."""
        return self.races.gain

    @fill_gain.setter
    def fill_gain(self, gain: float) -> None:
        self.races.gain = gain

    def resident(self, lid: int) -> bool:
        self._host()
        return self._slot_of[lid] >= 0

    @property
    def host_slot_of(self) -> list[int]:
        """The host mirror of `slot_of` ([N] lid -> slot, -1 when absent), for readers that
        walk many lids at once (one attribute lookup, not a call per lid). Read only."""
        self._host()
        return self._slot_of

    def touch(self, lids: list[int]) -> None:
        """One layer's visit (its distinct lids): settle the fill races waiting on this layer,
        count hits and misses, and move resident lids to the most-recent end of the LRU."""
        self._host()
        if lids:
            self.races.visit(lids[0] // self.lids_per_layer, lids, self._slot_of)
        last_hit, step = self.clock.last_hit, self.clock.step
        for lid in lids:
            if self._slot_of[lid] >= 0:
                self.hits += 1
                self._lru.move_to_end(lid)
                last_hit[lid] = step
            else:
                self.misses += 1

    def fill(
        self,
        lids: list[int],
        protect: set[int],
        after_compute: bool = True,
        publish: bool = True,
        race: bool = True,
        ahead_from: int | None = None,
    ) -> list[int]:
        """Bring `lids` (absent ones) into slots, evicting least-recently-used lids outside
        `protect` (the experts this layer is about to use). Returns the lids actually filled:
        fewer than asked when every slot is protected. `after_compute=False` lets the copies
        start at once: for callers whose queued compute is all discarded anyway (speculative
        graph segments, see segmented_graphs.py). `publish=False` leaves the device table to a
        later `publish(filled)`: publishing waits for the copies, so a caller with CPU work to
        overlap with them does that work first. `race=False`: the fills race nothing
        (fill_races.py; the bank's prefill chunks). `ahead_from`: for a prefill chunk, the
        first lid of the layers after the filling one; victims come from below it first
        (victims.py `prefill_victims`)."""
        self._host()
        self.inflight.settle()
        filled: list[int] = []
        lids = [lid for lid in lids if self._slot_of[lid] < 0]
        if not lids:
            return filled
        victims = None
        if ahead_from is not None:
            n, per, kept = len(lids) - len(self._free), self.lids_per_layer, self.kept_layers
            victims = prefill_victims(self._lru, protect, n, ahead_from, per, kept)
        claimed: list[int] = []  # lids given a slot by this call, copied or not
        try:
            if self.copy_stream is None:
                for lid in lids:
                    if not self._fill_one(lid, protect, race, victims, claimed):
                        break
                    filled.append(lid)
            else:
                # Victim slots may hold experts that queued compute still reads: the copies go
                # after it. The timing starts after that wait, so it measures the copies alone.
                if after_compute:
                    self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
                timing = tuple(torch.cuda.Event(enable_timing=True) for _ in range(2))
                with torch.cuda.stream(self.copy_stream):  # entered once: a fill is two copies
                    timing[0].record(self.copy_stream)  # named: a lookup of the stream is ~5 us
                    for lid in lids:
                        if not self._fill_one(lid, protect, race, victims, claimed):
                            break
                        filled.append(lid)
                    timing[1].record(self.copy_stream)
                self.fill_timings.append((*timing, len(filled) * self.pool.expert_bytes))
            if publish:
                self.publish(filled)
        except BaseException:
            self._undo_fill(claimed)
            raise
        return filled

    def _fill_one(
        self,
        lid: int,
        protect: set[int],
        race: bool,
        victims: deque[int] | None,
        claimed: list[int],
    ) -> bool:
        claimed.append(lid)  # first: an interruption inside the claim is undone too
        slot = self._claim(lid, protect, race, victims)
        if slot is None:
            claimed.pop()
            return False
        self._copy_in(lid, slot)
        return True

    def _undo_fill(self, claimed: list[int]) -> None:
        """A fill cut short (Ctrl-C, a failed copy): its lids leave the host maps, their slots
        free (what a copy left there is not trusted), and the whole device table is written
        from the host maps, the truth, so the two agree again. Left as it was, the maps named
        lids the device table did not (or a victim's slot it still did), and later steps ran
        with the wrong experts, with no error, until those lids were evicted."""
        for lid in claimed:  # (a claim cut short may have written only some of the maps)
            slot = self._slot_of[lid]
            self._slot_of[lid] = -1
            self._lru.pop(lid, None)
            if slot >= 0 and self._lid_of[slot] == lid:
                self._lid_of[slot] = -1
        # Every usable slot that holds no lid is free (a slot taken and not yet mapped too).
        top = self.max_slots - self._lent
        self._free = [s for s in range(top - 1, self.first_slot - 1, -1) if self._lid_of[s] < 0]
        self.races.drop(set(claimed))
        self.resync()

    def resync(self) -> None:
        """Write the whole device table from the host maps, the truth: after a fill cut short,
        or a step that failed or was interrupted between a fill and its publish (the maps
        then named lids the table did not, and later steps ran the wrong experts)."""
        self.table.unpublished = list(range(len(self._slot_of)))
        self.table.publish([])

    def _copy_in(self, lid: int, slot: int) -> None:
        """Copy `lid`'s rows from the pool into `slot` (on the current stream)."""
        pinned = self.pool.pinned
        self.w13[slot].copy_(self.pool.w13[lid], non_blocking=pinned)
        self.w2[slot].copy_(self.pool.w2[lid], non_blocking=pinned)

    def _claim(
        self, lid: int, protect: set[int], race: bool = True, victims: deque[int] | None = None
    ) -> int | None:
        """A slot for `lid` (evicting a victim outside `protect`, or the next of `victims`;
        None if there is none): the host maps and the fill's race are updated, the copy is the
        caller's."""
        slot, victim = self._take_slot(protect, victims)
        if slot is None:
            return None
        self.fills += 1
        self.bytes_filled += self.pool.expert_bytes
        self._slot_of[lid] = slot
        self._lid_of[slot] = lid
        self._lru[lid] = None
        if race:
            self.races.start(lid, victim)
        return slot

    def kept(self, lid: int) -> bool:
        """Whether `lid` belongs to a kept layer (`kept_layers`)."""
        return lid // self.lids_per_layer in self.kept_layers

    def _take_slot(
        self, protect: set[int], victims: deque[int] | None = None
    ) -> tuple[int | None, int]:
        """(a slot for a fill or None, the lid evicted from it or -1): a free slot, else the
        next of `victims` when given, else the least recently used lid that may go."""
        if self._free:
            return self._free.pop(), -1
        if victims is not None:
            if not victims:
                return None, -1
            return self._evict_for_fill(victims.popleft())
        victim = lru_victim(self._lru, protect, self.kept_layers, self.lids_per_layer)
        return (None, -1) if victim is None else self._evict_for_fill(victim)

    def _evict_for_fill(self, victim: int) -> tuple[int, int]:
        slot = self._slot_of[victim]
        self._evict(victim)
        self.table.unpublished.append(victim)
        return slot, victim

    def _evict(self, lid: int) -> None:
        """Drop `lid` from the host-side maps; the device table is the caller's to update."""
        slot = self._slot_of[lid]
        del self._lru[lid]
        self._slot_of[lid] = -1
        self._lid_of[slot] = -1

    def publish(self, lids: list[int]) -> None:
        """Write filled slots, and the evictions they replaced, into the device table
        (SlotTable.publish); compute queued from now on waits for the copies. A publish cut
        short (Ctrl-C in its write) had taken the evictions off the list: the whole table is
        written from the host maps before the error goes on."""
        try:
            self.table.publish(lids)
        except BaseException:
            self.resync()
            raise

    def lend(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Take the last `n` slots out of service and return them as scratch banks
        ([n, 2I, H], [n, H, I], contiguous even on the arena: `scratch_banks`): the prefill
        streamer stages its ring of absent experts there instead of in buffers of its own, so
        the budget holds more slots (see streaming.py). `take_back` returns them, empty.

        The cache keeps its hottest experts: the n coldest residents are evicted
        (wherever they live) and the survivors in the lent slots move into the slots that
        frees, one row copy a bank after queued compute, as `resize` does. Evicting whatever
        the top slots held had thrown out the experts filled last: after a lend, fills take the
        lowest free slot, which is the lent range's, so every prefill chunk evicted the
        previous decode's freshest fills."""
        self._host()
        if self._lent:
            raise RuntimeError("the expert cache's slots are already lent")
        self.inflight.settle()
        if n > self.n_slots:
            raise ValueError(f"cannot lend {n} of {self.n_slots} slots")
        room = self.n_slots - n  # slots that stay in service
        first = self.max_slots - n  # the top of the arena: resize moves only the bottom edge
        _, moved = vacate_slots(self, first, self.max_slots, room)
        self._lent = n
        self.publish(moved)
        return scratch_banks(self.w13, self.w2, self.arena, first, n)

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
        free slots. Shrinking evicts the coldest resident lids in LRU order
        until the residents fit, then moves each lid still below the new first_slot into a free
        kept slot: a device copy of its rows on the copy stream, after queued compute (which
        may read the old slot), as fills are. The table is published like a fill's, so compute
        queued afterwards sees the new slots, and writes into the vacated slots (KV, on the
        compute stream) come after the copies. Returns the evicted lids.

        Races whose filled lid is evicted here are dropped: a memory-manager eviction says
        nothing about whether that fill paid. Races with it as victim settle as usual (it is
        absent, as it was)."""
        self._host()
        assert not self._lent, "resize while cache slots are lent out"
        self.inflight.settle()
        if not 0 <= first_slot < self.max_slots:
            raise ValueError(f"first_slot {first_slot} outside [0, {self.max_slots})")
        old = self.first_slot
        if first_slot <= old:
            self._free = sorted(set(self._free) | set(range(first_slot, old)), reverse=True)
            self.first_slot = first_slot
            return []
        evicted, moved = vacate_slots(self, old, first_slot, self.max_slots - first_slot)
        self.first_slot = first_slot
        self.publish(moved)
        return evicted

    def evict_coldest(self, n: int, spare: Callable[[int], bool] | None = None) -> list[int]:
        """Evict the `n` least recently used resident lids (passing over those `spare` keeps),
        their slots to the free list. Not a fill's victims, so their races are dropped: they
        say nothing about whether fills pay. The device table learns of them with the next
        `publish`. Returns the evicted lids."""
        self._host()
        evicted = coldest(self._lru, n, spare)
        for lid in evicted:
            self._free.append(self._slot_of[lid])
            self._evict(lid)
        self.races.drop(set(evicted))
        self.table.unpublished += evicted
        return evicted

    def tick(self) -> None:
        """One engine step begins: hits from now on count for this step (HitClock.tick)."""
        self.clock.tick()

    def tail_profile(self, window: int, max_stale: int = 0) -> np.ndarray:
        """hot[k]: how many of the k least recently used resident lids were hit within
        the last `window` steps, for every k at once (HitClock.tail_profile).

        While the device owns the cache (policy gpu-fill, adaptive's device paths) the host's
        mirror is as the last hand-back left it at step `clock.mirror_step`. Up to `max_stale` steps
        after that, the profile is the mirror's as of then (the window ending at mirror_step,
        so it does not decay as the mirror ages); later, the cache is handed back first: a
        sync and a rebuild (~3.4 ms of host time at 3,000 slots on the dev box), which the
        elastic policy's refresh asked for about once every 16 decode steps at 48 layers."""
        clock = self.clock
        now = clock.step
        if self.on_device.owned and clock.step - clock.mirror_step <= max_stale:
            now = clock.mirror_step
        else:
            self._host()
        return clock.tail_profile(self._lru, window, now)

    def reset(self) -> None:
        """Empty every slot (benchmarks start each policy from the same state)."""
        self._host()
        self.inflight.settle()
        self.races.clear()
        for lid in list(self._lru):
            slot = self._slot_of[lid]
            self._evict(lid)
            self._free.append(slot)
        self.table.clear()
        self.kept_layers = frozenset()

    def clear_counters(self) -> None:
        self.hits = self.misses = self.fills = self.bytes_filled = 0

    def check_integrity(self) -> None:
        self._host()
        self.table.check(self.inflight.lids)
        seen = set()
        for lid, slot in enumerate(self._slot_of):
            if slot >= 0:
                assert self._lid_of[slot] == lid, f"slot {slot} maps back to {self._lid_of[slot]}"
                assert lid in self._lru, f"resident lid {lid} missing from the LRU"
                seen.add(slot)
        assert len(self._lru) == len(seen), "LRU holds lids without slots"
        assert not (seen & set(self._free)), "a used slot is on the free list"
        assert len(seen) + len(self._free) + self._lent == self.n_slots, "slots leaked"
        assert all(s >= self.first_slot for s in seen | set(self._free)), "a slot below first"
        assert all(lid < 0 for lid in self._lid_of[: self.first_slot]), "a lid below first_slot"
        lent = range(self.max_slots - self._lent, self.max_slots)
        assert all(self._lid_of[slot] < 0 for slot in lent), "a lent slot holds an expert"
        assert not (set(lent) & set(self._free)), "a lent slot is on the free list"
