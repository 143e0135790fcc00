"""Whole layers in the cache: adaptive's `layers` mode, the layout of `static` learnt at run time.

Under near-uniform routing every layout of S slots hits the same number of experts a token
(S * K / E on average), but not in the same number of layers. A decode step stops for the host
at every layer with a miss (the routing read back, the misses placed, the next segment
launched: tenths of a millisecond each on the H200 host). Slots spread over all L layers make
every layer stop; the same slots holding S // E whole layers leave those layers with no miss at
all. At 48 layers and 2537 slots (32 GB), `static` (19 whole layers) decoded 25.5 tok/s against
adaptive's 24.5 with the slots spread, though adaptive missed fewer experts. `static` keeps the
last layers whole with the same two functions (OffloadedExpertBank.place_static).

`kept_layers` picks the layers that already hold the most experts; `complete` fills their
missing experts, evicting least-recently-used experts of the other layers only. Afterwards the
mode fetches the kept layers' misses (experts another mode evicted) with victims from the other
layers, and runs every other miss on the CPU.
"""

from __future__ import annotations

import numpy as np


def whole_layers(cache) -> int:
    """How many whole layers the slots in service hold."""
    return (cache.n_slots - cache.lent) // cache.lids_per_layer


def kept_layers(cache, n_layers: int) -> frozenset[int]:
    """The layers to keep whole: as many as `whole_layers`, those holding the most experts now
    first (then the later layers, as `static` does)."""
    per = cache.lids_per_layer
    resident = (np.asarray(cache.host_slot_of[: n_layers * per]) >= 0).reshape(n_layers, per)
    counts = resident.sum(axis=1)
    order = sorted(range(n_layers), key=lambda layer: (-counts[layer], -layer))
    return frozenset(order[: whole_layers(cache)])


def complete(cache, layers: frozenset[int], protect: set[int], race: bool = False) -> list[int]:
    """Fill every missing expert of `layers`; victims (least recently used first) come from the
    other layers only, never in `protect`. Returns the lids filled (published)."""
    per = cache.lids_per_layer
    missing = [
        lid
        for layer in sorted(layers)
        for lid in range(layer * per, (layer + 1) * per)
        if not cache.resident(lid)
    ]
    if not missing:
        return []

    # The victims are chosen here in one walk of the LRU, not by `cache.fill` with
    # `kept_layers` set (which skips kept experts too): each fill's walk would pass every kept
    # expert at the cold end again, 67 ms against 10 ms for 48 layers and 2537 slots on the
    # dev box's CPU.
    def spare(lid: int) -> bool:
        return lid // per in layers or lid in protect

    cache.evict_coldest(len(missing) - cache.free_slots, spare)  # published with the fills
    # As many as the free slots now hold: a fill past them would evict a kept layer's expert.
    return cache.fill(missing[: cache.free_slots], protect, race=race)
