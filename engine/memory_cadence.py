"""When the MemoryManager's full decision is due (memory_manager.py holds one as `cadence`).

A full decision measures the demand and asks the policy: too costly for every safe point
while nothing it rests on moves. The steady key (`key`) is what can move it from one step to
the next; a decision runs when the key moved, or FULL_EVERY steps after the last one (the cold
tail's slow drift). It lives apart from memory_manager.py because it only reads (the running
and waiting requests, the split's sizes, the prefix cache's version) and says when to decide,
not what: the manager counts the steps, decides and carries the split out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from freetoken_agent.engine.memory_demand import pages_wanted

if TYPE_CHECKING:
    from freetoken_agent.engine.experts.cache import ExpertCache
    from freetoken_agent.engine.kv.checkpoints import CheckpointPool
    from freetoken_agent.engine.kv.pool import KVPool
    from freetoken_agent.engine.scheduler import Scheduler

FULL_EVERY = 32  # steps between full decisions while nothing but the cold tail can move
# (every 8, decisions took ~0.15 ms of the safe point's ~0.2 ms a step, on the dev box's CPU at
# 40 layers x 256 experts; the cold tail's hits are judged over 64 steps anyway)


class DecisionCadence:
    def __init__(
        self,
        scheduler: Scheduler,
        kv: KVPool,
        cache: ExpertCache,
        checkpoints: CheckpointPool | None,
    ) -> None:
        """`checkpoints`: the checkpoint pool when its device tier is in the split, else None."""
        self.scheduler, self.kv, self.cache, self.checkpoints = scheduler, kv, cache, checkpoints
        self.decided_on: tuple | None = None  # the steady key after the last full decision
        self.decided_at = 0  # its step

    def key(self, budget: int) -> tuple:
        """What the split rests on that can change from one step to the next: the budget, the
        split itself, which requests run and the pages they hold or want, the first waiting
        request, the prefix cache (its version) and the checkpoints held. While none of these
        moves (a decode step within its lookahead), the demand is the same but for the cold
        tail's hits, which drift over tens of steps: the full decision then runs every
        FULL_EVERY steps. Run every step, it cost 0.3-0.5 ms of a ~15 ms offloaded decode
        step on the device: about half of what elastic lagged fixed-last by on average."""
        sched, page_size = self.scheduler, self.kv.page_size
        first = sched.waiting[0] if sched.waiting else None
        return (
            budget,
            self.kv.allocator.n_pages,
            self.cache.n_slots,
            # Pages held or soon wanted, not held: a decode step that fills a page within its
            # lookahead changes neither the demand nor the decision.
            tuple((id(r), r.status, pages_wanted(r, page_size)) for r in sched.running),
            (id(first), first.n_tokens, len(sched.waiting)) if first is not None else None,
            sched.radix.version,
            self.checkpoints.device_used if self.checkpoints is not None else 0,
        )

    def due(self, key: tuple, step: int) -> bool:
        """Whether a full decision is due at `step`: something it rests on moved, or
        FULL_EVERY steps passed since the last."""
        return key != self.decided_on or step - self.decided_at >= FULL_EVERY
