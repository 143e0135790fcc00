"""The `direct` policy: cache misses read by the MoE kernels themselves, from the pinned pool.

Why (a departure from DESIGN idea 2's split of misses between fills and the CPU): offloaded
decode on the device is bound by the host, not by the link. Each MoE layer of each step stops
the GPU, hands the routing to the host, waits for it to fill or run the misses, and resumes:
40 round trips a step on the Qwen3.6 shape, 15-18 ms against ~3 ms of GPU work
(bench/results/NOTES.md, seventh session). Here nothing waits for the host within a step:

- a layer's experts come from their slot when resident and straight from the pool otherwise
  (`fused_moe`'s host banks: pinned host memory the kernels read over the link), chosen on the
  device (`direct_ids`), so a decode step is one CUDA graph, like a resident model's;
- after the step, the host reads every layer's routing (`RoutedLog`), counts hits, and fills
  the misses worth keeping into slots for the steps after (`OffloadedExpertBank.after_step`):
  all of them while fills win their races against their victims (temporal locality), only free
  slots once victims win (thrashing).

The CPU branch has no place here (it needs the round trip). Fills issued after a step cross
the link while the next step runs (engine/experts/inflight.py), one batch at a time: a step's
misses are not filled while the last batch is still crossing, so fills take what the link has
spare. (v1 finished them before the next step: on the H200 every miss then crossed twice, read
by the kernels and filled, and decode was no faster than `adaptive`.) Results equal every other
placement: the same kernels compute every pair from the same weights, wherever they are read
from, and whenever a fill lands.
"""

from __future__ import annotations

import numpy as np
import torch

from freetoken_agent.kernels.reference import host_ids

# T tokens, K top-k, L MoE layers, N = L * E lids


def direct_ids(slot_of: torch.Tensor, lids: torch.Tensor) -> torch.Tensor:
    """[T, K] fused-MoE ids: the slot of each resident lid, the pool row of the others (as
    host-bank ids). On the device, no sync: capturable."""
    slots = slot_of[lids]  # [T, K] int32, -1 where absent
    return torch.where(slots >= 0, slots.long(), host_ids(lids))


class RoutedLog:
    """The lids each MoE layer routed to during one eager step, kept on the device until the
    step ends (one sync for all layers then, instead of one per layer)."""

    def __init__(self) -> None:
        self._layers: list[torch.Tensor] = []

    def add(self, lids: torch.Tensor) -> None:
        self._layers.append(lids)

    def take(self) -> list[np.ndarray]:
        """The lids [T, K] int64 of each call since the last take, on the host."""
        layers, self._layers = self._layers, []
        return [lids.cpu().numpy() for lids in layers]
