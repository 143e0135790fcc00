"""MemoryManager: applies the elastic split (engine/memory.py decides) at the safe points.

Before each `schedule()` nothing is in flight on the host side, so the split may move: where a
full decision is due (engine/memory_cadence.py), the manager measures demand (`MemoryDemand`,
engine/memory_demand.py: the pages running requests hold and will need, the first waiting
request, the radix cache's recently used pages, the expert cache's cold tail), asks
`MemoryPolicy.decide`, and carries the answer out on the shared arena (engine/arena.py):

- slots shrink: the cache evicts its coldest experts (`ExpertCache.resize`), the boundary
  moves up, the page allocator grows into the freed bytes;
- pages shrink: pages in use above the new top move below it (kv/vacate.py: page copies, ids
  rewritten in the tree and in requests), the allocator shrinks, the boundary moves down,
  the cache gains free slots (filled on demand, as any slot).

Pointers never change (the arena is allocated once), so kernels and captured CUDA graphs stay
valid; the CPU pool is never reloaded. Every change is recorded in a `MemoryTrace`.

The budget never exceeds the ceiling (`EngineConfig.gpu_ceiling`: by default the device's
memory less the reserve), for which the arena reserved addresses. Below it, it is the lower of
the user's (`gpu_budget` at load or `set_gpu_budget`; without one, the ceiling) and, with a
watcher (`watch`: on CUDA at load, `EngineConfig.follow_free_memory`), what free device memory
allows: the engine keeps `memory_reserve` bytes free, so when another program takes VRAM the
budget drops by the shortfall at the next safe point, and when VRAM frees up (that program
exits, or one that ran before the engine loaded) the budget grows again
(engine/memory.py `BudgetWatcher`). A lower budget is enforced by the split
and made real by the arena's backing: the chunks above the last KV page (in every layer's lane)
and below the first slot are unmapped and go back to the driver (engine/device_memory.py);
growing maps them again, and a map that fails (someone else took the memory first) leaves the
split where it was.

When even the fewest slots leave too few pages for the running requests (the policy says
"over budget"), the newest running request is preempted (its pages go to the prefix cache; it
re-prefills later from there): never an out-of-memory.

Hybrid models: the checkpoints' device tier is on the KV side too (kv/checkpoints.py, a
resizable tier in lanes of reserved addresses). Before the policy runs, the manager sizes it
(`CheckpointTier.rows_for`: the checkpoints it holds plus a row per sequence that may run, at most a
16th of the budget and at most what running, waiting and recently used pages and the fewest
slots leave); the policy then splits what is left between pages and slots. A shrinking tier
spills its least recently used checkpoints to the host tier first; a growing one maps rows last.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import torch

from freetoken_agent.engine.arena import ElasticArena
from freetoken_agent.engine.kv.pool import KVPool
from freetoken_agent.engine.kv.vacate import vacate_pages
from freetoken_agent.engine.memory import (
    MIN_PAGES,
    BudgetWatcher,
    MemoryDemand,
    MemoryPolicy,
    MemoryTrace,
    Split,
)
from freetoken_agent.engine.memory_audit import check_manager_integrity, manager_stats
from freetoken_agent.engine.memory_cadence import DecisionCadence
from freetoken_agent.engine.memory_demand import DemandMeter
from freetoken_agent.engine.memory_tier import CheckpointTier
from freetoken_agent.engine.memory_workspace import StepWorkspace
from freetoken_agent.engine.scheduler import Scheduler


class MemoryManager:
    def __init__(
        self,
        arena: ElasticArena,
        kv: KVPool,
        bank,
        scheduler: Scheduler,
        fixed: int,
        budget: int,
        policy: MemoryPolicy | None = None,
        trace: MemoryTrace | None = None,
        explicit: bool = True,
        checkpoint_cap: Callable[[int], int] | None = None,
        workspace: StepWorkspace | None = None,
    ) -> None:
        """`fixed`: dense weights, workspace (a full step's), recurrent state slots (and a
        fixed checkpoint tier), staging of its own; `budget`: the budget at load (what the
        split was sized for); `explicit`: the user gave it (a cap the watcher keeps), else the
        watcher may grow it up to the ceiling; `checkpoint_cap(budget)`: the most checkpoint
        device rows at a budget, when the scheduler's checkpoint tier is resizable (then it is
        on the KV side of the split, see `CheckpointTier.rows_for`); `workspace`: the step
        workspace, whose part the next step cannot need is lent to the split
        (memory_workspace.py; None: the whole of it stays in `fixed`)."""
        self.arena, self.kv, self.bank, self.scheduler = arena, kv, bank, scheduler
        rec = scheduler.recurrence
        resizable = rec is not None and rec.checkpoints.resizable and checkpoint_cap is not None
        self.checkpoints = rec.checkpoints if resizable else None
        self.tier = CheckpointTier(self.checkpoints, scheduler.max_num_seqs, checkpoint_cap)
        self._checkpoint_target = self.checkpoints.device_rows if resizable else 0
        self.cache = bank.cache
        self.fixed_most = fixed  # with a full step's workspace: the floor and the ceiling
        self.workspace = workspace
        self.lent = 0  # workspace bytes the split may hold now (memory_workspace.py)
        self._return_cached = False  # lent grew: torch's cached blocks go back before a grow
        # The ceiling: what the arena's addresses hold, and the checkpoint tier as loaded (the
        # arena was sized beside it; a tier grown later takes its rows from the same budget).
        tier = self.checkpoints.device_bytes if resizable else 0
        self.max_budget = fixed + arena.nbytes + tier
        self.budget = min(budget, self.max_budget)
        self.user_budget = self.budget  # set_gpu_budget's, at most max_budget
        self.explicit = explicit
        self.policy = policy or MemoryPolicy()
        self.trace = trace or MemoryTrace()
        self.watcher: BudgetWatcher | None = None
        self.steps = 0
        self.safe_point_s = 0.0  # seconds spent in safe_point, summed
        self.preempted = 0
        self.released_bytes = 0  # arena bytes given back to the driver, over the run
        self.map_failures = 0  # grows refused because the device had no memory
        self.meter = DemandMeter(arena, kv, bank, scheduler)
        self.cadence = DecisionCadence(scheduler, kv, self.cache, self.checkpoints)
        self._decided: Split | None = None  # a split `quiet_point` decided, to carry out
        self._counted = False  # `quiet_point` counted this step, and left the decision
        self._record("load")

    # --- the budget -------------------------------------------------------------------------
    @property
    def fixed(self) -> int:
        """Bytes held outside the split now: `fixed_most` less the workspace lent to it."""
        return self.fixed_most - self.lent_held

    @property
    def lent_held(self) -> int:
        """Of the workspace lent (`lent`), what the split can hold now (`_lendable`)."""
        return self._lendable(self.budget, self.fixed_most + self.tier.nbytes())

    def _lendable(self, budget: int, fixed: int) -> int:
        """Of `lent`, what the split can hold beside `budget - fixed` bytes of its own: no more
        than the arena's addresses beyond them (an arena with no room to grow, as on a CPU
        device or under a budget at the ceiling, holds none of it)."""
        return max(0, min(self.lent, self.arena.nbytes - (budget - fixed)))

    @property
    def floor(self) -> int:
        """The least budget the engine can run in: fixed bytes (a full step's workspace: a
        prompt may come), MIN_PAGES KV pages, min_slots slots."""
        a = self.arena
        least = (self.fixed_most + MIN_PAGES * a.kv_unit.nbytes
                 + self.bank.min_slots * a.slot_unit.nbytes)  # fmt: skip
        return least + self.tier.row_bytes  # and one checkpoint row, when they are in the split

    @property
    def mapped_bytes(self) -> int:
        """Arena bytes backed by device memory now."""
        return self.arena.mapped_bytes

    def used_bytes(self) -> int:
        """What the engine holds on the device: fixed bytes and the arena's backed chunks."""
        return self.fixed + self.tier.nbytes() + self.mapped_bytes

    def held_bytes(self) -> int:
        """What the budget counts: fixed bytes, the pages and the slots of the split. The
        backed chunks hold a little more (partial chunks at every lane's top and at the first
        slot): that slack shows in free memory, so the watcher subtracts it by itself."""
        a = self.arena
        pages = self.kv.allocator.n_pages * a.kv_unit.nbytes
        return self.fixed + self.tier.nbytes() + pages + self.cache.n_slots * a.slot_unit.nbytes

    def set_budget(self, nbytes: int) -> None:
        """Applied at the next safe point. At most the ceiling (`max_budget`: the addresses
        the arena reserved, EngineConfig.gpu_ceiling); a budget below the floor is refused
        (raised to it, the engine would hold more than the user allowed)."""
        nbytes = int(nbytes)
        if nbytes < self.floor:
            a, rows = self.arena, self.tier.row_bytes
            raise ValueError(
                f"a GPU budget of {nbytes} bytes does not cover this engine's floor of "
                f"{self.floor}: {self.fixed_most} bytes of dense weights, workspace and recurrent "
                f"memory, 2 KV pages ({2 * a.kv_unit.nbytes})"
                + (f", a checkpoint row ({rows})" if rows else "")
                + f" and the {self.bank.min_slots} expert slots offloading runs with "
                f"({self.bank.min_slots * a.slot_unit.nbytes})"
            )
        self.user_budget = min(nbytes, self.max_budget)
        self.explicit = True
        if self.watcher is not None:
            self.watcher.set_budget(self.user_budget)
        self.budget = self._effective_budget(poll=False)

    def watch(self, free_memory, reserve: int | None = None, poll_s: float | None = None) -> None:
        """Follow free device memory: `free_memory()` -> (free, total) bytes. The budget becomes
        the lower of the user's and free + used - reserve (BudgetWatcher), read at the safe
        points at most every `poll_s` seconds. Without a budget from the user, the budget may
        grow up to the ceiling as memory frees up (another program exits)."""
        if not self.explicit:
            self.user_budget = self.max_budget
        self.watcher = BudgetWatcher(
            configured=self.user_budget,
            reserve=1 << 30 if reserve is None else int(reserve),
            poll_s=0.5 if poll_s is None else float(poll_s),
            free_memory=free_memory,
            used_by_engine=self.held_bytes,
            group_bytes=self.policy.group_bytes,
        )
        self.budget = self._effective_budget(poll=True)

    def _effective_budget(self, poll: bool) -> int:
        budget = self.user_budget
        if self.watcher is not None:
            watched = self.watcher.poll() if poll else self.watcher.budget
            if watched is not None:
                budget = min(budget, watched)
        return max(self.floor, budget)

    # --- the safe point ---------------------------------------------------------------------
    def safe_point(self) -> Split | None:
        t0 = time.perf_counter()
        try:
            return self._safe_point()
        finally:  # its cost per step, beside the step's (the elastic bench reports both)
            self._cap_step()
            self.safe_point_s += time.perf_counter() - t0

    def quiet_point(self) -> bool:
        """The safe point of a step launched with another in flight (engine/overlap.py). It
        polls, counts and decides as `safe_point` does (deciding reads host state only); True
        when nothing is to move. False when the split must move: it is kept, the caller
        completes the step in flight and calls `safe_point`, which carries it out. (A decode
        request crosses into a new page of lookahead every page_size tokens, which changes the
        steady key; draining for each of those decisions lost one overlap in 16.) A hybrid
        model's checkpoint tier is sized before the policy runs: when it would move, False,
        and `safe_point` decides again."""
        t0 = time.perf_counter()
        try:
            key = self._count()
            if not self.cadence.due(key, self.steps):
                self.policy.skip()
                return True
            demand = self.demand()
            if self.checkpoints is not None:
                rows = self.tier.rows_for(demand)
                if rows != self.checkpoints.device_rows:
                    self._counted = True  # `safe_point` decides without counting again
                    return False
                demand = self.tier.beside(demand, rows, self.arena.nbytes)
            self.cadence.decided_at = self.steps
            split = self._decide(demand)
            if split is None:
                self.cadence.decided_on = key
                return True
            self._decided, self.cadence.decided_on = split, None
            return False
        finally:
            self.safe_point_s += time.perf_counter() - t0

    def _safe_point(self) -> Split | None:
        if self._decided is not None:  # decided by `quiet_point`, counted there
            split, self._decided = self._decided, None
            if self._carry_out(split):
                self.cadence.decided_on = self._key()
            return split
        if self._counted:  # by `quiet_point`, which found the checkpoint tier moving
            self._counted = False
            key = self._key()
        else:
            key = self._count()
        if not self.cadence.due(key, self.steps):
            self.policy.skip()
            return None  # nothing a decision rests on moved but the cold tail's slow drift
        split, settled = self._decide_and_apply()
        # A split that could not be carried out yet is tried again at the next safe point.
        self.cadence.decided_on = self._key() if settled else None
        self.cadence.decided_at = self.steps
        return split

    def _count(self) -> tuple:
        """Count a safe point (the step, the cache's hit clock), poll the budget; returns the
        steady key."""
        self.steps += 1
        self.cache.tick()
        if self.watcher is not None:
            self.budget = self._effective_budget(poll=True)
        self._count_workspace()
        return self._key()

    def _key(self) -> tuple:
        """The cadence's steady key, and the workspace counted (a prompt's arrival or the end
        of its prefill moves the split at once)."""
        return (*self.cadence.key(self.budget), self.lent)

    # --- the step workspace (memory_workspace.py) ---------------------------------------------
    def _count_workspace(self) -> None:
        """Count the workspace the next step may need; lend the rest of a full step's."""
        ws = self.workspace
        if ws is None:
            return
        lent = ws.full - ws.bytes_for(ws.wanted(self.scheduler, self.meter.reused_tokens))
        if lent > self.lent:
            self._return_cached = True
        self.lent = lent

    def _cap_step(self) -> None:
        """Cap the scheduler's next step at the tokens the bytes outside the split cover."""
        ws = self.workspace
        if ws is None:
            return
        # What the budget leaves beside what is held, and the workspace still counted in it.
        room = self.budget - self.held_bytes() + ws.full - self.lent_held
        self.scheduler.step_tokens = ws.covered(room)

    def _decide_and_apply(self) -> tuple[Split | None, bool]:
        """Measure, decide and apply; returns the split and whether it was carried out."""
        settled = True
        demand = self.demand()
        if self.checkpoints is not None:
            rows = self.tier.rows_for(demand)
            if rows < self.checkpoints.device_rows:  # shrink first: its bytes may go elsewhere
                self._resize_checkpoints(rows)
            self._checkpoint_target = rows
            demand = self.tier.beside(demand, rows, self.arena.nbytes)
        split = self._decide(demand)
        if split is not None:
            settled = self._carry_out(split)
        if self.checkpoints is not None and self._checkpoint_target > self.checkpoints.device_rows:
            self._resize_checkpoints(self._checkpoint_target)  # grow last: the split made room
        return split, settled

    def _resize_checkpoints(self, rows: int) -> None:
        if self.tier.resize(rows, self._backed):
            self._record("checkpoints")

    def _carry_out(self, split: Split) -> bool:
        """Apply `split`; pages in use that cannot move below the new top preempt the newest
        running requests (their pages join the prefix cache, which can evict them) until they
        can. False when even that was not enough (tried again at the next safe point)."""
        while not self.apply(split):
            if not self._preempt_newest():
                return False
        return True

    def demand(self) -> MemoryDemand:
        """What the split must hold, with a full step's workspace outside it (the workspace
        lent to slots is added by `_decide`)."""
        return self.meter.measure(self.budget, self.fixed_most, self.steps)

    def _decide(self, demand: MemoryDemand) -> Split | None:
        """The policy's split, with the workspace lent now as slots only: pages hold requests,
        which a prompt's workspace could not take back without preempting; slots it evicts."""
        lent = self._lendable(demand.budget, demand.fixed)
        return self.policy.decide(replace(demand, lent=lent))

    # --- carrying a split out ---------------------------------------------------------------
    def apply(self, split: Split) -> bool:
        """Move to `split` (pages, the scratch page included; slots). False when the pages
        in use cannot move below the new top yet (it is tried again at the next safe point)."""
        arena, cache, alloc = self.arena, self.cache, self.kv.allocator
        # A streamed prefill chunk that failed midway still holds its staging slots (lent);
        # no chunk runs at a safe point, so they go back before the split moves them.
        self.bank.streamer.release()
        before = (alloc.n_pages, cache.n_slots)
        slots = split.slots
        # The policy counts bytes; the arena also loses a partial unit where pages meet slots
        # and at its top. Pages (the policy's priority) win: give up slots until they fit.
        # Pages count the scratch page (its bytes are spent too), and never fall below the
        # floor's MIN_PAGES: the slots give way for those too (taking the policy's pages, 1 on
        # an idle engine, then raising them to 2, held a slot more than the budget allowed).
        pb, want = arena.kv_unit.nbytes, max(MIN_PAGES, split.pages)
        while slots > self.bank.min_slots and arena.boundary_for(n_slots=slots) // pb < want:
            slots -= 1
        below = arena.boundary_for(n_slots=slots) // pb  # at most what lies below the slots
        pages = max(MIN_PAGES, min(want, below))
        if slots < cache.n_slots:  # experts give bytes up first
            cache.resize(arena.max_slots - slots)
            arena.set_boundary(arena.boundary_for(n_slots=slots))
        if pages < alloc.n_pages:
            copies = vacate_pages(alloc, self.scheduler.radix, self._requests(), pages)
            if copies is None:
                self._release()
                return False
            self.kv.copy_pages(copies)
            alloc.shrink(pages)
        # What the shrinking side gave up goes back first: the growing side may need it.
        self._release()
        if (slots > cache.n_slots or pages > alloc.n_pages) and self._return_cached:
            # The split grows into workspace a prefill's activations used, which torch's
            # allocator still caches: they go back to the driver first, or the engine would
            # hold both (more than its budget).
            self._return_cached = False
            if arena.device.type == "cuda":
                torch.cuda.empty_cache()
        # Growing needs memory behind the bytes first; a map the device refuses (another
        # program took it since the last poll) leaves that side where it was.
        if slots > cache.n_slots and self._map(alloc.n_pages, arena.max_slots - slots):
            arena.set_boundary(arena.boundary_for(n_slots=slots))
            cache.resize(arena.first_slot)
        pages = min(pages, arena.kv_pages)
        if pages > alloc.n_pages and self._map(pages, cache.first_slot):
            alloc.grow(pages)
        if (alloc.n_pages, cache.n_slots) != before or self._budget_unrecorded:
            self._record(split.reason)
        return True

    def _map(self, pages: int, first_slot: int) -> bool:
        """Back pages and slots with memory (see `_backed`)."""
        return self._backed(lambda: self.arena.map_for(pages, first_slot))

    def _backed(self, grow: Callable[[], bool]) -> bool:
        """Run `grow` (maps memory; False when the device refuses). When the device refuses,
        torch's allocator may be caching blocks it freed (a prefill chunk's activations took
        what the split released, under pressure): the split comes first, so those go back to
        the driver and `grow` is tried once more; a second refusal counts in map_failures."""
        if grow():
            return True
        if self.arena.device.type == "cuda":
            torch.cuda.empty_cache()
            if grow():
                return True
        self.map_failures += 1
        return False

    def _release(self) -> None:
        """Unmap what neither pages nor slots use (a no-op when nothing is newly unused)."""
        self.released_bytes += self.arena.release_unused(self.kv.allocator.n_pages,
                                                         self.cache.first_slot)  # fmt: skip

    def _requests(self):
        return [*self.scheduler.running, *self.scheduler.waiting]

    def _preempt_newest(self) -> bool:
        running = self.scheduler.running
        if len(running) <= 1:  # the oldest keeps going: something always progresses
            return False
        self.scheduler._preempt(running[-1])
        self.preempted += 1
        return True

    @property
    def _budget_unrecorded(self) -> bool:
        last = self.trace.records[-1] if len(self.trace) else None
        return last is None or last.budget != self.budget

    def _record(self, reason: str) -> None:
        self.trace.record(
            step=self.steps,
            budget=self.budget,
            kv_bytes=(self.kv.allocator.n_pages) * self.arena.kv_unit.nbytes,
            checkpoint_bytes=self._checkpoint_bytes(),
            slots=self.cache.n_slots,
            slot_bytes=self.cache.n_slots * self.arena.slot_unit.nbytes,
            pages=self.kv.allocator.n_pages,
            reason=reason,
            fixed_bytes=self.fixed,
        )

    def _checkpoint_bytes(self) -> int:
        rec = self.scheduler.recurrence
        return 0 if rec is None else rec.checkpoints.device_bytes

    def stats(self) -> dict:
        return manager_stats(self)

    def check_integrity(self) -> None:
        check_manager_integrity(self)
