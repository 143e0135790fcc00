"""MemoryManager: applies the elastic split (engine/memory.py decides) at the safe points.

Before each `schedule()` nothing is in flight on the host side, so the split may move: the
manager measures demand (`MemoryDemand`: the pages running requests hold and will need, the
first waiting request, the radix cache's recently used pages, the expert cache's cold tail),
asks `MemoryPolicy.decide`, and carries the answer out on the shared arena (engine/arena.py):

- slots shrink: the cache evicts its coldest experts (`ExpertCache.resize`), the boundary
  moves up, the page allocator grows into the freed bytes;
- pages shrink: pages in use above the new top move below it (kv/vacate.py: page copies, ids
  rewritten in the tree and in requests), the allocator shrinks, the boundary moves down,
  the cache gains free slots (filled on demand, as any slot).

Pointers never change (the arena is allocated once), so kernels and captured CUDA graphs stay
valid; the CPU pool is never reloaded. Every change is recorded in a `MemoryTrace`.

The budget is the load-time budget (`gpu_budget`, or free memory at load) until
`set_gpu_budget` lowers or restores it; it never exceeds the load-time one, whose bytes the
arena holds. Lowering it is enforced by the split (the engine uses fewer bytes); returning the
unused bytes of the arena to the driver, so another process can have them, needs the arena on
CUDA virtual memory (cuMemMap): the bytes between the KV top and the first slot are one
contiguous range, ready to be unmapped. That is the next step.

When even the fewest slots leave too few pages for the running requests (the policy says
"over budget"), the newest running request is preempted (its pages go to the prefix cache; it
re-prefills later from there): never an out-of-memory.
"""

from __future__ import annotations

from freetoken_agent.engine.arena import ElasticArena
from freetoken_agent.engine.experts.placement import workspace_bytes
from freetoken_agent.engine.kv.pool import KVPool
from freetoken_agent.engine.kv.recurrence import recurrent_device_bytes
from freetoken_agent.engine.kv.vacate import vacate_pages
from freetoken_agent.engine.memory import MemoryDemand, MemoryPolicy, MemoryTrace, Split
from freetoken_agent.engine.scheduler import Scheduler, Status

LOOKAHEAD_TOKENS = 256  # pages a running request is granted ahead of its next steps
RECENT_USES = 64  # cached pages touched in the last this-many radix uses count as recent
TAIL_WINDOW = 64  # steps over which the cache's cold tail is judged


class MemoryManager:
    def __init__(
        self,
        arena: ElasticArena,
        kv: KVPool,
        bank,
        scheduler: Scheduler,
        budget: int,
        policy: MemoryPolicy | None = None,
        trace: MemoryTrace | None = None,
    ) -> None:
        self.arena, self.kv, self.bank, self.scheduler = arena, kv, bank, scheduler
        self.cache = bank.cache
        self.max_budget = budget
        self.budget = budget
        self.fixed = budget - arena.nbytes  # dense, workspace, recurrent memory, staging
        self.policy = policy or MemoryPolicy()
        self.trace = trace or MemoryTrace()
        self.steps = 0
        self.preempted = 0
        self._record("load")

    # --- the user's budget ------------------------------------------------------------------
    def set_budget(self, nbytes: int) -> None:
        """Applied at the next safe point. At most the load-time budget (the arena's size)."""
        nbytes = int(nbytes)
        if nbytes <= self.fixed:
            raise ValueError(
                f"a GPU budget of {nbytes} bytes does not cover the {self.fixed} bytes of dense "
                "weights, workspace and recurrent memory"
            )
        self.budget = min(nbytes, self.max_budget)

    # --- the safe point ---------------------------------------------------------------------
    def safe_point(self) -> Split | None:
        self.steps += 1
        self.cache.tick()
        split = self.policy.decide(self.demand())
        if split is None:
            return None
        # Pages in use that cannot move below the new top: preempt the newest running
        # requests (their pages join the prefix cache, which can evict them) until they can.
        while not self.apply(split):
            if not self._preempt_newest():
                break
        return split

    def demand(self) -> MemoryDemand:
        sched, s = self.scheduler, self.kv.page_size
        running = [r for r in sched.running if r.status is Status.RUNNING]
        held = len({p for r in running for p in r.pages}) + 1  # + the scratch page
        growth = 0
        for r in running:
            left = r.n_tokens - r.num_computed + max(0, r.sampling.max_tokens - len(r.output_ids))
            want = -(-(r.num_computed + min(left, LOOKAHEAD_TOKENS)) // s)
            growth += max(0, want - len(r.pages))
        waiting = 0
        if sched.waiting:  # its whole prompt, and its first answer tokens, as for growth
            w = sched.waiting[0]
            waiting = -(-(w.n_tokens + min(w.sampling.max_tokens, LOOKAHEAD_TOKENS)) // s)
        clock = sched.radix.clock
        recent = stale = 0
        for node in sched.radix._nodes():
            if node.ref == 0:
                if node.last_used > clock - RECENT_USES:
                    recent += 1
                else:
                    stale += 1
        return MemoryDemand(
            budget=self.budget,
            fixed=self.fixed,
            page_bytes=self.arena.kv_unit.nbytes,
            slot_bytes=self.arena.slot_unit.nbytes,
            pages_now=self.kv.allocator.n_pages,
            slots_now=self.cache.n_slots,
            pages_held=held,
            pages_growth=growth,
            pages_waiting=waiting,
            cached_recent=recent,
            cached_stale=stale,
            min_slots=self.bank.min_slots,
            max_slots=min(self.bank.pool.n_rows, self.arena.max_slots),
            slot_tail_hits=lambda k: self.cache.tail_hits(k, TAIL_WINDOW),
        )

    # --- carrying a split out ---------------------------------------------------------------
    def apply(self, split: Split) -> bool:
        """Move to `split` (pages, the scratch page included; slots). False when the pages
        in use cannot move below the new top yet (it is tried again at the next safe point)."""
        arena, cache, alloc = self.arena, self.cache, self.kv.allocator
        before = (alloc.n_pages, cache.n_slots)
        slots = split.slots
        # The policy counts bytes; the arena also loses a partial unit where pages meet slots
        # and at its top. Pages (the policy's priority) win: give up slots until they fit.
        pb = arena.kv_unit.nbytes
        while slots > self.bank.min_slots and arena.boundary_for(n_slots=slots) // pb < split.pages:
            slots -= 1
        # Pages count the scratch page (its bytes are spent too); at most what lies below the
        # slots.
        below = arena.boundary_for(n_slots=slots) // pb
        pages = max(2, min(split.pages, below))
        if slots < cache.n_slots:  # experts give bytes up first
            cache.resize(arena.max_slots - slots)
            arena.set_boundary(arena.boundary_for(n_slots=slots))
        if pages < alloc.n_pages:
            copies = vacate_pages(alloc, self.scheduler.radix, self._requests(), pages)
            if copies is None:
                return False
            for src, dst in copies:
                self.kv.copy_page(src, dst)
            alloc.shrink(pages)
        if slots > cache.n_slots:
            arena.set_boundary(arena.boundary_for(n_slots=slots))
            cache.resize(arena.first_slot)
        pages = min(pages, arena.kv_pages)
        if pages > alloc.n_pages:
            alloc.grow(pages)
        if (alloc.n_pages, cache.n_slots) != before or self._budget_unrecorded:
            self._record(split.reason)
        return True

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
        return 0 if rec is None else rec.checkpoints.stats()["device_bytes"]

    def stats(self) -> dict:
        return {
            "budget": self.budget,
            "max_budget": self.max_budget,
            "fixed_bytes": self.fixed,
            "kv_pages": self.kv.allocator.n_pages,
            "slots": self.cache.n_slots,
            "changes": len(self.trace),
            "preempted": self.preempted,
        }

    def check_integrity(self) -> None:
        arena, alloc = self.arena, self.kv.allocator
        arena.check_integrity()
        assert alloc.n_pages <= arena.kv_pages, "KV pages beyond the arena's boundary"
        assert self.cache.first_slot >= arena.first_slot, "slots below the arena's boundary"
        used = (alloc.n_pages * arena.kv_unit.nbytes + self.cache.n_slots
                * arena.slot_unit.nbytes)  # fmt: skip
        assert used <= arena.nbytes, "pages and slots overlap"


def elastic_memory(loaded, scheduler: Scheduler) -> MemoryManager | None:
    """The MemoryManager when KV pages and expert slots share an arena (engine/arena.py). Its
    budget is what the arena was sized from: the fixed bytes (dense weights, workspace,
    recurrent memory, staging buffers of their own) plus the arena."""
    bank = loaded.bank
    arena = getattr(getattr(bank, "cache", None), "arena", None)
    if arena is None:
        return None
    spec, config = loaded.spec, loaded.config
    fixed = (
        loaded.dense_bytes
        + workspace_bytes(spec, config)
        + recurrent_device_bytes(spec, config, loaded.device, loaded.dtype, arena.nbytes)
        + bank.nbytes
        - bank.cache.nbytes
    )
    policy = MemoryPolicy(group_bytes=config.elastic_group_bytes)
    return MemoryManager(arena, loaded.kv, bank, scheduler, fixed + arena.nbytes, policy)
