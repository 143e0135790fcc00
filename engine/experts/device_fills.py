"""Policy `gpu-fill`: the decode graph fills its own cache misses, with no host decision.

Why (a departure from DESIGN idea 2, as `direct` is): on the H200 host offloaded decode is
paced by the host. A segmented step stops after every router that misses, and the host's
decision takes ~120 us before its first copy even starts (bench/results/NOTES.md, fifteenth
session); on layers that hit, its Python check and a graph launch (~50 + 23 us) are as long as
the layer's device work. Here each MoE layer of a captured step runs three kernels in place of
the stop (kernels/expert_fills.py): a one-program plan (look the layer's lids up, stamp the
hits, give each miss the least recently used slot outside the layer, update the table), a copy
of the missing experts from the pinned pool into their slots (SMs reading host memory at about
the link's rate), and the MoE kernels reading the slots. So a step is one graph replay, as a
resident model's is, and a miss crosses the link once, into the slot that keeps it. The CPU
branch has no place here (it needs the host); misses that find no slot (every slot used by the
layer) are read from the pool by the MoE kernels, as `direct` reads them. `adaptive` runs
the same kernels as its device path, where they measure faster than its stops
(engine/experts/step_paths.py). Measured on the H200 at b=1: native routing 721 against 543
tok/s on the 12-layer peer slice, Zipf routing 98.9 against 75.1 at 48 layers and 32 GB.

Ownership. The cache's host mirror (slot_of, lid_of, the LRU, the free list) is the truth
everywhere else. `own` hands it to the device: stamps from the LRU order (free slots -1, slots
out of service and kept layers' PINNED), the clock past them. From then on the device tables
are the truth and the mirror is stale until `release` reads them back (one sync) and rebuilds
it: residents ordered by stamp, the lids used since `own` counted as hit this step. Every
cache method that reads or changes the mirror releases first (ExpertCache.`_host`); a decode
step under gpu-fill owns again (a no-op while owned). Counters stay on the device and are
folded into the bank's and the cache's on `fold` (the bank's `stats` property) and `release`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from freetoken_agent.kernels import reference_fills as layout

if TYPE_CHECKING:
    from freetoken_agent.engine.experts.cache import ExpertCache

# S slots (the cache's max_slots), M = most pairs a decode step's layer routes


class DeviceFills:
    def __init__(self, cache: ExpertCache, max_pairs: int) -> None:
        self.cache = cache
        device, s = cache.device, cache.max_slots
        self.lid_of = torch.full((s,), -1, dtype=torch.int32, device=device)  # [S]
        self.stamp = torch.full((s,), layout.PINNED, dtype=torch.int64, device=device)  # [S]
        self.state = torch.zeros(layout.STATE, dtype=torch.int64, device=device)
        self.moves = torch.zeros((max_pairs, 2), dtype=torch.int64, device=device)  # [M, 2]
        # Slots pinned for their popularity (popular_pins.py), until `own` rebuilds the stamps.
        self.popular = torch.zeros(s, dtype=torch.bool, device=device)  # [S]
        self.owned = False
        self.releases = 0  # hand-backs to the host (each one sync and a rebuild)
        self.stats = None  # the bank's OffloadStats (set by the bank): fold adds to it
        self._clock_at_own = 0
        self._folded = [0] * layout.STATE  # counters already added to the host's
        self.share = 0  # CPU_SHARE the plans read (cpu_share.py; 0: every miss filled)
        self.all_misses = False  # CPU_ALL_MISSES: the share may take a layer's every miss
        self.cut = 0  # SPLIT_COLS the split plans read (split_expert.py sets it before them)
        # The split expert's tables (`enable_split`): each slot's columns, the copies landed.
        self.split: layout.SplitTables | None = None
        # Called first by `release`: the split expert's copies behind must land before the
        # host reads the tables (split_expert.py `drain`).
        self.before_release: Callable[[], None] | None = None
        self._seq = 0  # the last SEQ posted to the CPU worker: it never goes back

    def own(self) -> None:
        """Hand the cache to the device (a no-op while it has it)."""
        if self.owned:
            return
        c = self.cache
        c.inflight.settle()
        c.publish([])  # evictions not yet in the device table
        stamp = [layout.PINNED] * c.max_slots
        for slot in c._free:
            stamp[slot] = -1
        for rank, lid in enumerate(c._lru):  # least recent first
            stamp[c._slot_of[lid]] = layout.PINNED if c.kept(lid) else rank
        state = [0] * layout.STATE
        state[layout.CLOCK] = self._clock_at_own = len(c._lru)
        state[layout.CPU_SHARE], state[layout.SEQ] = self.share, self._seq
        state[layout.CPU_ALL_MISSES] = int(self.all_misses)
        state[layout.SPLIT_COLS] = self.cut
        if self.split is not None:  # the last release drained: every slot whole, none in flight
            self.split.cols.fill_(self.split.width)
            self.split.landed.fill_(-1)
        self.lid_of.copy_(torch.tensor(c._lid_of, dtype=torch.int32))
        self.stamp.copy_(torch.tensor(stamp, dtype=torch.int64))
        self.popular.zero_()
        self.state.copy_(torch.tensor(state, dtype=torch.int64))
        self._folded = [0] * layout.STATE
        self.owned = True
        c.clock.mirror_step = c.clock.step  # the mirror is the truth up to here

    def set_share(self, value: int, all_misses: bool = False) -> None:
        """CPU_SHARE and CPU_ALL_MISSES for the next plans (in stream order while owned; `own`
        writes them)."""
        if value != self.share:
            self.share = value
            if self.owned:
                self.state[layout.CPU_SHARE : layout.CPU_SHARE + 1].fill_(value)
        if all_misses != self.all_misses:
            self.all_misses = all_misses
            if self.owned:
                self.state[layout.CPU_ALL_MISSES : layout.CPU_ALL_MISSES + 1].fill_(int(all_misses))

    def enable_split(self, width: int) -> layout.SplitTables:
        """The split expert's tables for experts of width I (once; kept afterwards)."""
        if self.split is None:
            s, dev = self.cache.max_slots, self.cache.device
            self.split = layout.SplitTables(
                torch.full((s,), width, dtype=torch.int32, device=dev),  # [S]
                torch.full((s,), -1, dtype=torch.int64, device=dev),  # [S]
                width,
            )
        return self.split

    def set_cut(self, value: int) -> None:
        """SPLIT_COLS for the next plans (in stream order while owned; `own` writes it). A
        cut changes only with no slot in flight (split_expert.py)."""
        if value == self.cut:
            return
        self.cut = value
        if self.owned:
            self.state[layout.SPLIT_COLS : layout.SPLIT_COLS + 1].fill_(value)

    def fold(self) -> None:
        """Add the device's counters since the last fold to the bank's and the cache's
        (one sync)."""
        now = self.state.tolist()
        d = [a - b for a, b in zip(now, self._folded, strict=True)]
        self._folded = now
        self._seq = now[layout.SEQ]
        c = self.cache
        c.hits += d[layout.HITS]
        c.misses += d[layout.FILLS] + d[layout.HOST_READS] + d[layout.CPU_EXPERTS]
        c.fills += d[layout.FILLS]
        c.bytes_filled += d[layout.FILLS] * c.pool.expert_bytes
        st = self.stats
        if st is not None:
            st.pairs += d[layout.PAIRS]
            st.experts += d[layout.EXPERTS]
            st.hits += d[layout.HITS]
            st.fetched += d[layout.FILLS]
            st.direct += d[layout.HOST_READS]
            st.on_cpu += d[layout.CPU_EXPERTS]
            st.split += d[layout.SPLITS]
            st.split_hits += d[layout.PARTIAL_HITS]

    def release(self) -> None:
        """Give the cache back to the host: rebuild its mirror from the device tables."""
        if not self.owned:
            return
        if self.before_release is not None:
            self.before_release()
        self.fold()
        self.owned = False
        self.releases += 1
        c = self.cache
        lid_of = self.lid_of.tolist()
        stamp = self.stamp.tolist()
        popular = self.popular.tolist()
        lent_from = c.max_slots - c.lent
        residents = sorted(
            (stamp[s], s, lid_of[s]) for s in range(c.first_slot, lent_from) if lid_of[s] >= 0
        )
        c._slot_of[:] = [-1] * len(c._slot_of)
        c._lid_of[:] = lid_of
        c._lru.clear()
        for st, slot, lid in residents:
            c._slot_of[lid] = slot
            c._lru[lid] = None
            # Used while the device owned it: a stamp since `own`, or pinned for its uses.
            if self._clock_at_own < st < layout.PINNED or popular[slot]:
                c.clock.last_hit[lid] = c.clock.step
        c.clock.mirror_step = c.clock.step
        used = {slot for _, slot, _ in residents}
        c._free = [s for s in range(lent_from - 1, c.first_slot - 1, -1) if s not in used]
        # The device's fills raced nothing; the host's pending races are moot. The mean stays:
        # adaptive reads its verdict on every step of the device paths (`_path_allowed`).
        c.races.drop_pending()
