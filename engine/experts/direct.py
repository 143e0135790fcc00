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

from freetoken_agent.engine.experts.graph_io import distinct_lids
from freetoken_agent.engine.experts.policy import FETCH_NONE_GAIN
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


def learn_after_step(bank, graph_tokens: int | None) -> None:
    """After a step of `bank` (an OffloadedExpertBank under policy direct): count the step's
    hits and fill the misses worth keeping (all while fills win their races, free slots only
    once victims win). Routing from the replayed graph's buffers (`graph_tokens` tokens) or the
    eager step's log (`bank.routed`)."""
    if graph_tokens is not None:
        if bank.device.type == "cuda":  # the routing the graph copies to pinned memory
            torch.cuda.current_stream(bank.device).synchronize()
        layers = range(bank.spec.n_moe_layers)
        routed = [bank._graph_lids(layer, graph_tokens) for layer in layers]
    else:
        routed = bank.routed.take()
    cache, stats, want, used = bank.cache, bank.stats, [], set()
    # Claimed before this step, published only now: this step still read them from the pool.
    # Fills whose copies have landed serve the next step.
    crossing = cache.inflight.lids
    cache.inflight.publish_ready()
    for lids in routed:
        uniq, counts = distinct_lids(lids)
        misses = bank._misses(uniq, counts, lids.size)
        late = sum(1 for lid in uniq if lid in crossing) if crossing else 0
        stats.hits -= late  # the mirror counts them resident; the step read the pool
        stats.direct += len(misses) + late
        want += [lid for _, lid in misses]
        used.update(uniq)
    if cache.inflight:
        return  # the link is busy with the last batch: this step's misses stay in the pool
    if cache.fill_gain < FETCH_NONE_GAIN:
        want = want[: cache.free_slots]
    # One batch for the whole step, evicting only experts this step did not use; its copies
    # cross the link while the next step runs (inflight.py), which reads them from the pool
    # until they have landed.
    stats.fetched += len(cache.inflight.start(want, used))
