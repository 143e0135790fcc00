"""The elastic split of the GPU budget: the decision side (DESIGN sections 1 idea 3, and 5).

One budget pays for `fixed` bytes (dense weights, workspace, recurrent state slots, and the
checkpoint device tier, which the manager sizes before asking: the policy does not move
them), KV pages of `page_bytes` (every
attention layer's K and V of one page) and expert slots of `slot_bytes` (every tensor of one
(layer, expert) pair). At a scheduler safe point the engine fills a `MemoryDemand`;
`MemoryPolicy.decide` answers the split to move to, or None to keep the current one. The
mechanics (the arena's moving boundary, page migration, slot eviction) are the engine's.

Units. Everything is decided in bytes and converted once: the bytes left for pages after S
slots are `avail - S * slot_bytes` with `avail = budget - fixed`, and the page count is their
floor division by `page_bytes` (a page is never split). So a returned split always satisfies
`fixed + pages * page_bytes + slots * slot_bytes <= budget` (when `budget >= fixed`: a budget
below the dense weights is a load error, the engine's to raise). The policy chooses the slot
count; pages take every remaining byte, because a free page costs nothing and admits the next
request without a move.

The policy is a priority list, each level served only from what the ones above leave:

1. Hard. Pages of running requests (`pages_held + pages_growth`: their KV now and over the
   lookahead), then, if they also fit, the first waiting request's (`pages_waiting`; else
   its prompt's and first token's, `pages_waiting_least`: it runs, growing as pages free;
   an idle engine's `min_pages` are its first pages, not counted twice), and
   `min_slots` slots (offloading cannot run with fewer). If running pages plus `min_slots`
   do not fit, the answer is the pages that fit with reason "over budget": the engine
   preempts the newest request or keeps requests waiting. Never an out-of-memory. This
   answer comes at every safe point while the shortage lasts, even when the split is
   unchanged: it tells the engine to preempt.
2. Expert slots up to their knee. The cache's `slot_tail_hits(k)` says how many hits per step
   the k least-recently-used slots earned; the cold end is given up group by group while a
   group's hits per GiB stay below `cold_hits_per_gib`. Slots that earn their bytes stay.
3. Recently used cached KV pages (`cached_recent`): an agent's next turn reuses them, and
   losing them costs a re-prefill of the whole history.
4. The rest: slots up to `max_slots` (beyond that every expert is resident: no gain), then
   pages (stale cached pages first by the radix LRU, then free pages).

`cached_stale` is not needed by the decision (stale pages get only the leftover, like free
pages): it is in the snapshot for the engine's stats.

Moves. The slot count moves in whole groups of `group_bytes` (ceil(group_bytes / slot_bytes)
slots): a smaller move costs a migration for a gain below measurement noise. A target less
than a group away is not taken, rounding toward the current count. A move opposite to the last
one waits `min_gap` safe points (no back and forth while demand wobbles around a boundary).
Both rules yield to the hard level: a split that no longer covers level 1 (the budget shrank,
a request grew, a request waits) moves at once, as far as level 1 needs.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

GIB = 1 << 30
MIN_PAGES = 2  # the fewest KV pages a split keeps: the scratch page and one to run in


@dataclass(slots=True, frozen=True)
class MemoryDemand:
    """A snapshot taken at a safe point; the engine fills it, the policy only reads it."""

    budget: int  # bytes the engine may use on the device now
    fixed: int  # dense weights + workspace + recurrent slots + checkpoint device tier
    page_bytes: int  # one KV page (all attention layers)
    slot_bytes: int  # one expert slot (0: experts resident, nothing to trade)
    pages_now: int
    slots_now: int
    pages_held: int  # pages running requests hold (their KV), never given up
    pages_growth: int  # pages those requests will need over the next steps (lookahead)
    pages_waiting: int  # pages the first waiting request needs to be admitted (0 if none)
    cached_recent: int  # radix-cached pages used within the recency window
    cached_stale: int  # the other cached pages
    min_slots: int  # the fewest slots offloading can run with (prefill staging)
    max_slots: int  # slots that would hold every expert (no gain beyond)
    slot_tail_hits: Callable[[int], float]  # hits/step lost if the k coldest slots went
    min_pages: int = MIN_PAGES
    # Of pages_waiting, the fewest it can be admitted with: its prompt and first token (it
    # grows as it decodes; without its lookahead it may have to wait for pages to free).
    pages_waiting_least: int = 0
    # Of `fixed`, the workspace the next step cannot need (engine/memory_workspace.py): it
    # holds slots only (pages hold requests, which a prompt's workspace could not take back).
    lent: int = 0

    @property
    def pages_admitting(self) -> int:
        """Pages for the running requests and the first waiting one, at least min_pages (an
        idle engine's scratch page and the page to run in are the waiting one's first)."""
        return max(self.pages_held + self.pages_growth + self.pages_waiting, self.min_pages)


@dataclass(slots=True, frozen=True)
class Split:
    pages: int
    slots: int
    reason: str


class MemoryPolicy:
    """Decides the split (module docstring); remembers only its last move, for hysteresis."""

    def __init__(
        self,
        group_bytes: int = 64 << 20,
        cold_hits_per_gib: float = 32.0,
        min_gap: int = 8,
    ) -> None:
        # group_bytes: 64 MiB is ~10 Qwen3.6 expert slots or a few hundred KV pages; a move
        #   costs a page migration / slot refill, so smaller moves are not worth one.
        # cold_hits_per_gib: a GiB of slots is weighed against a GiB of recently used KV.
        #   The KV: ~11k tokens of a Qwen3-30B-shaped history (98 KB a token), whose loss
        #   costs a re-prefill on the agent's next turn: ~1.5 s at ~7k tokens/s streamed.
        #   The slots: a hit saves one expert fetch (~9.4 MB at ~55-100 GB/s, ~170 us); over
        #   a turn of ~256 decode steps, 32 hits/step per GiB save ~1.4 s. Below that the
        #   history is worth more. Near-uniform routing at 41% cached gives ~7 hits/step
        #   per GiB (cold: the history wins); a hot working set under locality stays.
        # min_gap: safe points between opposite moves; a decode step is ~10 ms, so 8 steps
        #   keep a wobbling demand from migrating memory on every step.
        if group_bytes <= 0:
            raise ValueError(f"group_bytes must be positive, got {group_bytes}")
        self.group_bytes = group_bytes
        self.cold_hits_per_gib = cold_hits_per_gib
        self.min_gap = min_gap
        self._safe_points = 0
        self._last_dir = 0  # +1 slots grew, -1 slots shrank, 0 none yet
        self._last_move = -(10**9)  # safe point of the last move

    def group_slots(self, slot_bytes: int) -> int:
        """Slots in one move group (at least one)."""
        return max(1, -(-self.group_bytes // slot_bytes)) if slot_bytes else 0

    def skip(self) -> None:
        """A safe point that did not ask (nothing moved): the hysteresis counts it still."""
        self._safe_points += 1

    def decide(self, d: MemoryDemand) -> Split | None:
        """The split to move to, or None. The lent workspace's slots (`lent_slots`) come on
        top: the levels below decide the slots `fixed` leaves room for, as without it."""
        free = self.lent_slots(d)
        if not free:
            return self._decide(d)
        paid = replace(
            d,
            slots_now=max(0, d.slots_now - free),
            min_slots=max(0, d.min_slots - free),
            max_slots=max(0, d.max_slots - free),
            lent=0,
        )
        split = self._decide(paid)
        return None if split is None else Split(split.pages, split.slots + free, split.reason)

    @staticmethod
    def lent_slots(d: MemoryDemand) -> int:
        """Slots the lent workspace holds (the hottest ones: the levels weigh the cold end),
        at most every expert."""
        return min(d.lent // d.slot_bytes, d.max_slots) if d.slot_bytes else 0

    def _decide(self, d: MemoryDemand) -> Split | None:
        self._safe_points += 1
        pb, sb = d.page_bytes, d.slot_bytes
        avail = d.budget - d.fixed
        min_slots = d.min_slots if sb else d.slots_now  # resident experts: slots cost nothing
        # An idle engine holds only the scratch page, but the engine keeps min_pages whatever
        # the split says: counted here, or the slots took their bytes and the split held up to
        # a slot more than the budget.
        running = max(d.pages_held + d.pages_growth, d.min_pages)
        if avail < running * pb + min_slots * sb:
            return self._over_budget(d, avail, min_slots)
        hard = d.pages_admitting
        if avail < hard * pb + min_slots * sb:  # not with its lookahead: with its prompt
            hard = max(d.pages_held + d.pages_growth + d.pages_waiting_least, d.min_pages)
        if avail < hard * pb + min_slots * sb:
            hard = running  # the waiting request stays waiting: no room even at min_slots
        if sb == 0:  # nothing to trade: pages take everything
            return self._move(d, d.slots_now, hard, 0, "budget")
        s_hard = (avail - hard * pb) // sb  # the most slots level 1 leaves
        max_slots = max(d.max_slots, min_slots)
        # Levels 2-4 in bytes (rem: bytes not yet given; hard pages and min_slots come first).
        rem = avail - hard * pb - min_slots * sb
        contest = self._contested(d, rem, min_slots, max_slots)
        knee = self._knee(d, min_slots) if contest else max_slots
        s = min_slots + min(max(knee - min_slots, 0), rem // sb)
        rem -= (s - min_slots) * sb
        recent = min(d.cached_recent, rem // pb)
        rem -= recent * pb
        s += min(max(max_slots - s, 0), rem // sb)
        target = min(s, s_hard)
        if target > d.slots_now:
            cause = "kv released"
        elif contest and recent and knee < d.slots_now:
            cause = "cold slots"  # level 2 gave up a cold tail for level 3 (else: hard pages)
        else:
            cause = "kv demand"
        return self._move(d, target, hard, s_hard, cause)

    def _move(
        self, d: MemoryDemand, target: int, hard: int, s_hard: int, cause: str
    ) -> Split | None:
        """Apply groups and hysteresis to a slot target; pages take the remaining bytes."""
        pb, sb = d.page_bytes, d.slot_bytes
        avail = d.budget - d.fixed
        used = d.pages_now * pb + d.slots_now * sb
        forced = used > avail or d.pages_now < hard or (sb and d.slots_now < d.min_slots)
        slots = d.slots_now
        if sb:
            g = self.group_slots(sb)
            delta = target - d.slots_now
            step = (abs(delta) // g) * g * (1 if delta > 0 else -1)  # toward the current count
            slots = d.slots_now + step
            if forced:  # level 1 moves as far as it needs, group or not
                slots = min(slots, s_hard)
                slots = max(slots, d.min_slots)
        pages = (avail - slots * sb) // pb
        direction = (slots > d.slots_now) - (slots < d.slots_now)
        if forced:
            return self._took(Split(pages, slots, f"hard: {cause} ({hard} pages)"), direction)
        if direction == 0:
            if abs(pages - d.pages_now) * pb < self.group_bytes:
                return None
            return self._took(Split(pages, slots, "budget"), 0)
        if direction == -self._last_dir and self._safe_points - self._last_move < self.min_gap:
            return None  # too soon after the opposite move
        return self._took(Split(pages, slots, cause), direction)

    def _took(self, split: Split, direction: int) -> Split:
        if direction:
            self._last_dir, self._last_move = direction, self._safe_points
        return split

    def _over_budget(self, d: MemoryDemand, avail: int, min_slots: int) -> Split:
        """Level 1 fails: min_slots slots (fewer if even they do not fit), pages that fit."""
        sb = d.slot_bytes
        if avail <= 0:
            return Split(0, 0 if sb else d.slots_now, "over budget")
        slots = min(min_slots, avail // sb) if sb else d.slots_now
        return Split((avail - slots * sb) // d.page_bytes, slots, "over budget")

    @staticmethod
    def _contested(d: MemoryDemand, rem: int, min_slots: int, max_slots: int) -> bool:
        """Whether recent pages and slots compete for the `rem` bytes left after level 1. Only
        then does the knee (a profile of the whole LRU, ~4,000 slots) change the split: without
        recent pages, or with room for all of both, levels 2-4 give max_slots (capped by rem)
        whatever it is (a decode step with no recent cached pages skips it)."""
        need = (max_slots - min_slots) * d.slot_bytes + d.cached_recent * d.page_bytes
        return d.cached_recent > 0 and rem < need

    def _knee(self, d: MemoryDemand, min_slots: int) -> int:
        """Fewest slots keeping every group that earns >= cold_hits_per_gib. The k coldest by
        LRU are assumed the least used, so a group's hits grow toward the hot end (the tail is
        convex) and the first hot group is found by bisection: O(log) calls of tail_hits."""
        now = min(d.slots_now, max(d.max_slots, min_slots))
        if now <= min_slots:
            return now
        g = self.group_slots(d.slot_bytes)
        n_groups = -(-(now - min_slots) // g)

        def cold(n: int) -> bool:  # is the n-th coldest group (1-based) below the threshold?
            hi, lo = min(n * g, now - min_slots), (n - 1) * g
            lost = d.slot_tail_hits(hi) - (d.slot_tail_hits(lo) if lo else 0.0)
            return lost / ((hi - lo) * d.slot_bytes / GIB) < self.cold_hits_per_gib

        lo, hi = 0, n_groups  # the answer: the number of leading cold groups, in [lo, hi]
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if cold(mid):
                lo = mid
            else:
                hi = mid - 1
        return max(min_slots, now - lo * g)


@dataclass(slots=True)
class TraceRecord:
    time: float  # seconds since the trace began
    step: int
    budget: int
    kv_bytes: int  # pages * page_bytes
    checkpoint_bytes: int  # recurrent-state checkpoints on the device
    slots: int
    slot_bytes: int  # bytes all slots take (slots * one slot's bytes)
    pages: int
    reason: str
    fixed_bytes: int = 0  # dense + workspace (+ recurrent slots): the plot's bottom layer


class MemoryTrace:
    """Every change of the split. Bounded: the first `keep_first` records (the session's
    start, where the layout is set) and a ring of the latest `keep_last` (4096 records at
    ~100 bytes is ~0.4 MB of JSON: hours of serving at one change per few seconds)."""

    def __init__(
        self,
        keep_first: int = 64,
        keep_last: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.keep_first = keep_first
        self.keep_last = keep_last
        self._clock = clock
        self._t0 = clock()
        self._first: list[TraceRecord] = []
        self._last: deque[TraceRecord] = deque(maxlen=keep_last)
        self.dropped = 0

    def record(
        self,
        *,
        step: int,
        budget: int,
        kv_bytes: int,
        checkpoint_bytes: int,
        slots: int,
        slot_bytes: int,
        pages: int,
        reason: str,
        fixed_bytes: int = 0,
    ) -> TraceRecord:
        rec = TraceRecord(
            self._clock() - self._t0,
            step,
            budget,
            kv_bytes,
            checkpoint_bytes,
            slots,
            slot_bytes,
            pages,
            reason,
            fixed_bytes,
        )
        if len(self._first) < self.keep_first:
            self._first.append(rec)
        else:
            if len(self._last) == self.keep_last:
                self.dropped += 1
            self._last.append(rec)
        return rec

    @property
    def records(self) -> list[TraceRecord]:
        return self._first + list(self._last)

    def __len__(self) -> int:
        return len(self._first) + len(self._last)

    def to_json(self) -> dict:
        return {
            "keep_first": self.keep_first,
            "keep_last": self.keep_last,
            "dropped": self.dropped,
            "records": [asdict(r) for r in self.records],
        }


class BudgetWatcher:
    """The budget to use, following free device memory.

    The engine may use what it holds plus what is free, less `reserve` (left for the driver,
    other programs' small allocations, fragmentation): `free + used_by_engine - reserve`, never
    above the cap (the user's `set_budget`, else `configured`, else `total - reserve`). When
    another process takes VRAM so that free < reserve, the budget drops by the shortfall at the
    next poll, whatever its size (waiting could make the other process fail). Otherwise it
    moves only by at least `group_bytes`, so a few MiB of noise in `free` does not move the
    split back and forth. Memory is read at most every `poll_s` seconds (mem_get_info is a
    driver call; the engine asks every safe point)."""

    def __init__(
        self,
        configured: int | None,
        reserve: int,
        poll_s: float,
        free_memory: Callable[[], tuple[int, int]],
        used_by_engine: Callable[[], int],
        group_bytes: int = 64 << 20,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.configured = configured
        self.reserve = reserve
        self.poll_s = poll_s
        self._free_memory = free_memory
        self._used = used_by_engine
        self.group_bytes = group_bytes
        self._clock = clock
        self._user: int | None = None
        self._last_poll: float | None = None
        self._total: int | None = None
        self._budget: int | None = None
        self._available = 0  # free + used - reserve at the last poll
        self.polls = 0

    def _cap(self) -> int | None:
        if self._user is not None:
            return self._user
        if self.configured is not None:
            return self.configured
        return None if self._total is None else self._total - self.reserve

    def set_budget(self, nbytes: int | None) -> None:
        """The user's explicit budget (None: back to the configured one). Takes effect at
        once, without reading memory: lower at once, higher up to what was free last poll."""
        self._user = nbytes
        if self._budget is not None:
            cap = self._cap()
            self._budget = max(0, self._available if cap is None else min(cap, self._available))

    def poll(self) -> int:
        """The budget now; reads device memory only when poll_s has passed since the last read."""
        now = self._clock()
        if self._last_poll is None or now - self._last_poll >= self.poll_s:
            self._last_poll = now
            self.polls += 1
            free, total = self._free_memory()
            self._total = total
            self._available = free + self._used() - self.reserve
            self._budget = self._follow(free)
        assert self._budget is not None
        return self._budget

    @property
    def budget(self) -> int | None:
        """The last budget returned (None before the first poll)."""
        return self._budget

    def _follow(self, free: int) -> int:
        cap = self._cap()
        target = max(0, self._available if cap is None else min(cap, self._available))
        cur = self._budget
        if cur is None:
            return target
        if free < self.reserve:  # another process needs memory: the shortfall goes, whole
            return min(cur, target)
        if cap is not None and cur > cap:  # the cap was lowered
            return target
        return target if abs(target - cur) >= self.group_bytes else cur


def cuda_free_memory(device: object = None) -> Callable[[], tuple[int, int]]:
    """The production `free_memory`: (free, total) bytes of the device, from the driver."""
    import torch

    return lambda: torch.cuda.mem_get_info(device)
