"""Building the MemoryManager of a loaded model: what is fixed outside the split, the budget at
load, the watcher of free device memory (engine/memory_manager.py applies the split)."""

from __future__ import annotations

from freetoken_agent.engine.experts.placement import workspace_bytes
from freetoken_agent.engine.kv.recurrence import device_row_cap
from freetoken_agent.engine.memory import MemoryPolicy, cuda_free_memory
from freetoken_agent.engine.memory_manager import MemoryManager
from freetoken_agent.engine.memory_workspace import StepWorkspace
from freetoken_agent.engine.scheduler import Scheduler


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
        + workspace_bytes(spec, config, offloaded=True)
        # What the recurrence holds outside the split (sized again from the arena, whose
        # addresses reach the ceiling, it was overstated by 6.6 GB, a third of the split, on
        # the Qwen3.6 shape on the device); a resizable checkpoint tier is in the split.
        + (loaded.recurrence.fixed_device_bytes if loaded.recurrence is not None else 0)
        + bank.nbytes
        - bank.cache.nbytes
    )
    policy = MemoryPolicy(group_bytes=config.elastic_group_bytes)
    # The budget at load: the user's, or what the split was sized for (free memory at load).
    rec = loaded.recurrence
    sized = (
        fixed
        + (rec.device_bytes - rec.fixed_device_bytes if rec is not None else 0)
        + arena.initial_pages * arena.kv_unit.nbytes
        + (arena.n_slots + 1) * (arena.slot_unit.nbytes)
    )
    explicit = config.gpu_budget is not None
    budget = config.gpu_budget if explicit else sized

    def checkpoint_cap(b: int) -> int:
        return device_row_cap(spec, loaded.dtype, b)

    workspace = StepWorkspace(spec, config) if config.lend_workspace else None
    manager = MemoryManager(arena, loaded.kv, bank, scheduler, fixed, budget, policy, None,
                            explicit, checkpoint_cap, workspace)  # fmt: skip
    if loaded.device.type == "cuda" and config.follow_free_memory:
        manager.watch(cuda_free_memory(loaded.device), config.memory_reserve, config.memory_poll_s)
    return manager
