"""The checkpoints' device tier in the elastic split (hybrid models): a mixin of MemoryManager
(memory_manager.py). When the checkpoint pool's device tier is resizable it sits on the KV side
of the split: each full decision sizes it first (`_checkpoint_rows`) and the policy splits what
is left between pages and slots (`_beside_tier`)."""

from __future__ import annotations

from dataclasses import replace

from freetoken_agent.engine.memory import MemoryDemand


class CheckpointTier:
    @property
    def _row_bytes(self) -> int:
        return self.checkpoints.row_bytes if self.checkpoints is not None else 0

    def _tier_bytes(self) -> int:
        """Bytes of the checkpoints' device tier when it is in the split (else in `fixed`)."""
        return self.checkpoints.device_bytes if self.checkpoints is not None else 0

    def _checkpoint_rows(self, d: MemoryDemand) -> int:
        """The checkpoint device rows this safe point asks for, on the KV side of the split:
        the checkpoints the tier holds plus a row per sequence that may run (room for new
        snapshots without a spill), at most a 16th of the budget (a fixed tier's share) and
        at most what the pages of running requests, of the first waiting one and of recently
        used history, and the fewest slots, leave; the policy splits the rest between pages
        and slots. A session's anchors make the tier grow; a cut budget shrinks it, spilling
        the least recently used checkpoints to the host tier; a released history gives its
        rows back."""
        pool, per = self.checkpoints, self._row_bytes
        # Recently used cached pages come first too: a checkpoint is worth nothing without
        # the KV of the tokens before it (evicting those pages releases it).
        pages = d.pages_held + d.pages_growth + d.pages_waiting + d.cached_recent
        hard = pages * d.page_bytes + d.min_slots * d.slot_bytes
        room = (d.budget - d.fixed - hard) // per
        want = pool.device_used + self.scheduler.max_num_seqs
        return max(1, min(self._checkpoint_cap(d.budget), want, room))

    def _resize_checkpoints(self, rows: int) -> None:
        pool = self.checkpoints
        if rows == pool.device_rows:
            return
        if rows > pool.device_rows:
            if not self._backed(lambda: pool.resize_device(rows) == rows):
                return
        else:
            pool.resize_device(rows)
        self._record("checkpoints")

    def _beside_tier(self, demand: MemoryDemand, rows: int) -> MemoryDemand:
        """The demand pages and slots split, beside a checkpoint tier of `rows`: the rest, at
        most what the arena holds (the budget's ceiling counts the tier as loaded, which these
        rows may leave partly unused)."""
        fixed = demand.fixed + rows * self._row_bytes
        budget = min(demand.budget, fixed + self.arena.nbytes)
        return replace(demand, fixed=fixed, budget=budget)
