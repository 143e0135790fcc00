"""The offloaded bank's half of decode under captured graphs (engine/segmented_graphs.py).

A decode step's graph is cut after each MoE layer's router. The segment before the cut exports
the layer's routing and activations to pinned memory (`_captured`, first half); between
segments the host places the layer's misses (`resolve`); the segment after the cut sums the
experts from slots plus the CPU's part (`_captured`, second half). A mixin of
OffloadedExpertBank (offload.py), which holds the cache, the policy and `_misses`/`_place`.

A departure from DESIGN section 8 ("no mixins"), kept on purpose: this is not a second concept
but the graph-captured half of the bank's one decode state machine (a hit here waits in the
bank's `_hits` for the same `_visited` bookkeeping the eager path does, and a miss goes through
the same `_misses`/`_place`), split off by file size. As a component it would hold a reference
back to the bank and call eight of its private members; the Scheduler's and the MemoryManager's
former mixins, which each used a few of their host's fields, became components.
"""

from __future__ import annotations

import numpy as np
import torch

from freetoken_agent.engine.experts.graph_io import GraphIO, distinct_of
from freetoken_agent.kernels.fused_moe import fused_moe
from freetoken_agent.kernels.routing_export import export_routing


class GraphDecode:
    """Mixed into OffloadedExpertBank, whose attributes it reads: `spec`, `device`, `policy`,
    `n_experts`, `cache`, `stats`, `graph_io` (set here), `_hits`, `_misses`, `_visited`,
    `_place`, `_direct`, `_gpu_fill`."""

    def attach_graph_io(self, max_tokens: int, dtype: torch.dtype) -> GraphIO:
        """Static buffers for graph-captured decode of up to `max_tokens` tokens per step;
        the ones already attached when they fit (adaptive captures three sets of graphs over
        them: path_graphs.py)."""
        spec, io = self.spec, self.graph_io
        if io is not None and io.ids.shape[1] >= max_tokens and io.hidden.dtype == dtype:
            return io
        self.graph_io = GraphIO(
            spec.n_moe_layers, max_tokens, spec.top_k, spec.hidden_size, dtype, self.device
        )
        return self.graph_io

    def _captured(
        self,
        layer: int,
        hidden: torch.Tensor,  # [T, H]
        topk_ids: torch.Tensor,  # [T, K]
        topk_weights: torch.Tensor,  # [T, K]
    ) -> torch.Tensor:
        """What a decode graph records for one MoE layer. The routing and the activations go
        to pinned host memory and the segment ends: the host looks at them (`resolve`) before
        the next segment, which computes the experts from slots and adds what the CPU computed
        for this layer, clearing that buffer for the next step (zero when nothing), in the
        MoE's own summing kernel. Every kernel here runs for every layer of every step, hit
        or miss: the export is one kernel, not three copies; the slots come from the layer's
        slice of the table in one gather, not a cast, an offset and a gather of all lids; and
        the CPU part needs no add or clear of its own."""
        io = self.graph_io
        t = hidden.shape[0]
        if self.policy == "direct":  # one graph a step: nothing for the host until it ends
            io.ids[layer, :t].copy_(topk_ids, non_blocking=True)
            return self._direct(hidden, topk_ids.long() + layer * self.n_experts, topk_weights)
        if self.whole_step_capture:  # gpu-fill's (adaptive's device) path: fills its misses
            return self._gpu_fill(layer, hidden, topk_ids, topk_weights, None)
        export_routing(topk_ids, topk_weights, hidden, io.ids[layer, :t], io.weights[layer, :t],
                       io.hidden[layer, :t])  # fmt: skip
        io.split()
        e = self.n_experts
        table = self.cache.slot_of[layer * e : (layer + 1) * e]  # [E] this layer's lid -> slot
        rows = table.index_select(0, topk_ids.reshape(-1)).view(topk_ids.shape)  # [T, K]
        part = io.cpu_part[layer, :t]  # [T, H]
        return fused_moe(hidden, self.cache.w13, self.cache.w2, rows, topk_weights, add=part)

    def resolve(self, layer: int, n_tokens: int) -> bool:
        """After a graph segment exported `layer`'s routing: place its misses (fetch q*, run
        the rest on the CPU into the layer's CPU buffer). True when the layer missed, so the
        segments after it must run (again) to see the new slots and the CPU part."""
        io, cache = self.graph_io, self.cache
        in_flight = cache.inflight.lids if cache.inflight else None
        cache.inflight.settle()  # fills behind (or of direct, a benchmark switched policy)
        lids = self._routed(layer, n_tokens)
        if not in_flight and self._hit(lids):
            return False
        self.flush_hits()  # the layers before this one first, as they came
        uniq_l, counts = distinct_of(lids)
        misses = self._misses(uniq_l, counts, len(lids))
        if not misses:
            # A segment queued before the settle read the table without these lids' entries:
            # the layer runs again. (`settle_fills` leaves none in flight across steps.)
            return bool(in_flight) and not in_flight.isdisjoint(uniq_l)

        rows = io.views(layer, n_tokens)

        # Everything queued on the device now is either finished (up to this layer's segment)
        # or speculative and about to run again: the fills need not wait for it.
        def cpu_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            ids = torch.tensor(lids, dtype=torch.int64).view(n_tokens, -1)  # [T, K]
            return rows.hidden, ids, rows.weights

        part, fetched = self._place(misses, uniq_l, cpu_inputs, n_tokens, after_compute=False,
                                    into=rows.cpu_stage)  # fmt: skip
        if part is not None:  # the CPU's sum is in the pinned stage: to the device
            rows.cpu_part.copy_(part, non_blocking=True)
        cache.publish(fetched)
        return True

    def _routed(self, layer: int, n_tokens: int) -> list[int]:
        """[T * K] the lids `layer`'s exported routing asks for, token by token, as a list:
        the host's decisions are Python, and one list serves the hit check, the distinct
        count and the CPU branch's ids (numpy's cast and add, then a list of it, had cost
        ~16 us of a stop's host time before its first copy on the dev box)."""
        base = layer * self.n_experts
        return [base + e for e in self.graph_io.ids_np[layer, :n_tokens].ravel().tolist()]

    def _hit(self, lids: list[int]) -> bool:
        """Whether every one of `lids` (one layer's routing) is in a slot. A hit's bookkeeping
        (`_visited`: LRU moves, race visits and counts) waits in `_hits` for `flush_hits`.
        Most layers of most decode steps hit, and the host resolves each before its next
        segment's launch: where it takes longer than a layer's device work the device waits
        on it. In the engine's loop on the dev box (12 layers, Zipf trace) a hit took 22.7 us
        through the general path, 13.6 with its bookkeeping done at once, and 6 with it
        waiting; the flush then costs ~2.4 us a hit, in a batch with warm caches."""
        slot_of = self.cache.host_slot_of
        for lid in lids:
            if slot_of[lid] < 0:
                return False
        self._hits.append(lids)
        return True

    def flush_hits(self) -> None:
        """The waiting hits' bookkeeping, in the order the layers came: the visit `_misses`
        makes of a layer (`_visited`), with no misses. Called before anything that reads the
        LRU, the races or the counts: a layer that misses (before its own touch, so victims
        are chosen as without the wait), the end of a step's replay (segmented_graphs.py), an
        eager call, `after_step` and `check_integrity`."""
        if not self._hits:
            return
        hits, self._hits = self._hits, []
        for lids in hits:
            self._visited(sorted(set(lids)), len(lids), n_misses=0)

    def settle_fills(self) -> None:
        """Before a decode step's first segment: fills still in flight from the step before
        (AdaptiveFetches.behind) are published, so no segment of this step reads the table without
        them where `resolve` could not tell (its check covers this step's fills only)."""
        self.cache.inflight.settle()

    def _graph_lids(self, layer: int, n_tokens: int) -> np.ndarray:
        """[T, K] int64 lids of the routing a decode graph exported for `layer`."""
        return self.graph_io.ids_np[layer, :n_tokens].astype(np.int64) + layer * self.n_experts
