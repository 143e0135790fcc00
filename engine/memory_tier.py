"""The checkpoints' device tier in the elastic split (hybrid models). When the checkpoint
pool's device tier is resizable it sits on the KV side of the split: each of the
MemoryManager's full decisions (memory_manager.py, which holds one as `tier`) sizes it first
(`rows_for`) and the policy splits what is left between pages and slots (`beside`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from freetoken_agent.engine.memory import MemoryDemand


class CheckpointTier:
    def __init__(self, pool: Any, max_num_seqs: int, cap: Callable[[int], int] | None) -> None:
        """`pool`: the recurrence's checkpoint pool when its device tier is in the split (else
        None: every figure is 0); `cap(budget)`: the most device rows at a budget."""
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.cap = cap

    @property
    def row_bytes(self) -> int:
        return self.pool.row_bytes if self.pool is not None else 0

    def nbytes(self) -> int:
        """Bytes of the device tier when it is in the split (else counted in `fixed`)."""
        return self.pool.device_bytes if self.pool is not None else 0

    def rows_for(self, d: MemoryDemand) -> int:
        """The checkpoint device rows a safe point asks for, on the KV side of the split: the
        checkpoints the tier holds plus a row per sequence that may run (room for new
        snapshots without a spill), at most a 16th of the budget (a fixed tier's share) and
        at most what the pages of running requests, of the first waiting one and of recently
        used history, and the fewest slots, leave; the policy splits the rest between pages
        and slots. A session's anchors make the tier grow; a cut budget shrinks it, spilling
        the least recently used checkpoints to the host tier; a released history gives its
        rows back."""
        pool, per = self.pool, self.row_bytes
        # Recently used cached pages come first too: a checkpoint is worth nothing without
        # the KV of the tokens before it (evicting those pages releases it). The running pages
        # are counted as the split counts them (MemoryPolicy.decide: at least the pages the
        # engine always keeps), or an idle engine's tier took a row from a waiting request's.
        pages = d.pages_admitting + d.cached_recent
        hard = pages * d.page_bytes + d.min_slots * d.slot_bytes
        room = (d.budget - d.fixed - hard) // per
        want = pool.device_used + self.max_num_seqs
        return max(1, min(self.cap(d.budget), want, room))

    def resize(self, rows: int, backed: Callable[[Callable[[], bool]], bool]) -> bool:
        """Give the tier `rows` device rows, a grow through `backed` (the manager's: refused
        when the device has no memory for it). Whether the rows changed."""
        pool = self.pool
        if rows == pool.device_rows:
            return False
        if rows > pool.device_rows:
            return backed(lambda: pool.resize_device(rows) == rows)
        pool.resize_device(rows)
        return True

    def beside(self, demand: MemoryDemand, rows: int, arena_bytes: int) -> MemoryDemand:
        """The demand pages and slots split, beside a tier of `rows`: the rest, at most what
        the arena holds (the budget's ceiling counts the tier as loaded, which these rows may
        leave partly unused)."""
        fixed = demand.fixed + rows * self.row_bytes
        budget = min(demand.budget, fixed + arena_bytes)
        return replace(demand, fixed=fixed, budget=budget)
