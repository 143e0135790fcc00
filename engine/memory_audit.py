"""What a MemoryManager reports about itself: its figures (`stats`, read into `Engine.stats()`)
and the invariants that bind the split to the arena and the page allocator (`check_integrity`,
which the tests assert through `Engine.check_integrity`).

Both only read the manager, and neither runs on the safe point's path, so they live apart from
memory_manager.py, which carries splits out; `MemoryManager.stats` and
`MemoryManager.check_integrity` delegate here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from freetoken_agent.engine.memory_manager import MemoryManager


def manager_stats(manager: MemoryManager) -> dict:
    """The budget and its ceilings, the arena's backing, the split and its history."""
    return {
        "budget": manager.budget,
        "max_budget": manager.max_budget,
        "user_budget": manager.user_budget,
        "mapped_bytes": manager.mapped_bytes,
        "released_bytes": manager.released_bytes,
        "map_failures": manager.map_failures,
        "watching": manager.watcher is not None,
        "reserve": None if manager.watcher is None else manager.watcher.reserve,
        "fixed_bytes": manager.fixed,
        # Of a full step's workspace, what the split may hold now (memory_workspace.py).
        "workspace_lent": manager.lent_held,
        "kv_pages": manager.kv.allocator.n_pages,
        "slots": manager.cache.n_slots,
        "checkpoint_rows": None if manager.checkpoints is None else manager.checkpoints.device_rows,
        "changes": len(manager.trace),
        "preempted": manager.preempted,
    }


def check_manager_integrity(manager: MemoryManager) -> None:
    """Pages and slots within their sides of the arena's boundary, apart, and backed."""
    arena, alloc = manager.arena, manager.kv.allocator
    arena.check_integrity()
    assert alloc.n_pages <= arena.kv_pages, "KV pages beyond the arena's boundary"
    assert manager.cache.first_slot >= arena.first_slot, "slots below the arena's boundary"
    used = (alloc.n_pages * arena.kv_unit.nbytes + manager.cache.n_slots
            * arena.slot_unit.nbytes)  # fmt: skip
    assert used <= arena.nbytes, "pages and slots overlap"
    assert arena.kv_backed(alloc.n_pages), "a usable KV page is not backed by memory"
