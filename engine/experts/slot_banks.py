"""Where the expert cache's slots live: banks of its own, or the elastic arena's slot views.

Either way the slots mirror the pool's banks (`w13 [S, 2I, H]`, `w2 [S, H, I]`), so a fill is
one copy per bank and the fused MoE kernels read slots exactly as they read a resident bank. On
the arena (engine/arena.py) they are its views over every slot position, rows strided, and the
usable ones start at the arena's first slot; a range lent as staging is handed out as
contiguous banks over the same bytes (`scratch_banks`). It lives apart from cache.py because it
is storage, set once at load: the cache decides what the slots hold.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from freetoken_agent.engine.experts.pool import ExpertPool

if TYPE_CHECKING:
    from freetoken_agent.engine.arena import ElasticArena

# S slots (S_max on the arena), H hidden, I expert width


def slot_banks(
    pool: ExpertPool, n_slots: int, device: torch.device, arena: ElasticArena | None
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(w13, w2, the first usable slot). Standalone: `n_slots` slots of the cache's own (at
    most one a pool row). On `arena`: the arena's slot views, usable from `arena.first_slot`
    (`n_slots` is ignored). At least one usable slot is required."""
    if arena is not None:
        assert arena.w13 is not None, "the arena has no slot unit"
        assert arena.w13.shape[1:] == pool.w13.shape[1:] and arena.w13.dtype == pool.w13.dtype
        w13, w2 = arena.w13, arena.w2  # [S_max, 2I, H], [S_max, H, I] strided
        first_slot = arena.first_slot
        n_slots = arena.n_slots
    else:
        n_slots = min(n_slots, pool.n_rows)
        w13_shape, w2_shape = (n_slots, *pool.w13.shape[1:]), (n_slots, *pool.w2.shape[1:])
        w13 = torch.empty(w13_shape, dtype=pool.w13.dtype, device=device)
        w2 = torch.empty(w2_shape, dtype=pool.w2.dtype, device=device)
        first_slot = 0
    if n_slots < 1:
        raise ValueError(f"the expert cache needs at least one slot, got {n_slots}")
    return w13, w2, first_slot


def scratch_banks(
    w13: torch.Tensor, w2: torch.Tensor, arena: ElasticArena | None, first: int, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots first .. first+n-1 (the top of the banks, holding no experts) as scratch banks
    ([n, 2I, H], [n, H, I]), contiguous even on the arena."""
    if arena is not None:  # its slot views are strided: staging wants plain DMA
        return arena.scratch_banks(first, n)
    return w13[first:], w2[first:]
