"""Which resident experts the expert cache evicts, and in what order.

Pure readings of the cache's LRU order (resident lids, least recently used first): a fill's
victim (`lru_victim`), a prefill chunk's fills' victims (`prefill_victims`), and the coldest
lids evicted to make room outside the fills (`coldest`: a shrink, a lend, a layer layout).
They live apart from cache.py because they are the eviction policy, which changes nothing;
the cache carries their answers out (its host maps, the free list, the device table).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterable

# N = L * E lids, a lid's layer is lid // lids_per_layer


def lru_victim(
    lru: Iterable[int], protect: set[int], kept_layers: frozenset[int], lids_per_layer: int
) -> int | None:
    """The least recently used lid a fill may evict: outside `protect` (the experts the filling
    layer is about to use) and outside the kept layers; None when every lid is one of those."""
    for victim in lru:
        if victim not in protect and (
            not kept_layers or victim // lids_per_layer not in kept_layers
        ):
            return victim
    return None


def prefill_victims(
    lru: Iterable[int],
    protect: set[int],
    n: int,
    ahead_from: int,
    lids_per_layer: int,
    kept_layers: frozenset[int],
) -> deque[int]:
    """Up to `n` lids for a prefill chunk's fills to evict, in this order: those below
    `ahead_from` (the layers it has passed, and the filling layer's experts it does not
    use), then those of kept layers it has passed, then any other, least recently used
    first within each. A chunk of more than a few dozen tokens touches nearly every expert
    of every layer, so the LRU's oldest lids are the layers ahead (last touched a chunk
    ago), which this chunk is about to use: evicting them trades each fill for a miss a
    few layers on, while the layers passed are needed again only by the next step. Kept
    layers (`kept_layers`: decode's whole-layer layout) are victims too, after the others
    passed: a chunk confined to the slots outside them ran most of every other layer's
    misses on the CPU at dozens of tokens each (on the H200 host's peer slice, 18 of 73
    a layer took 247 ms at 768 tokens, where streaming took 190); decode fetches a kept
    layer's evicted experts back as routing asks for them. One walk of the LRU a call."""
    per, kept = lids_per_layer, kept_layers
    buckets: tuple[deque[int], deque[int], deque[int]] = (deque(), deque(), deque())
    passed, passed_kept, ahead = buckets
    for lid in lru:
        if len(passed) >= n:
            break
        if lid in protect:
            continue
        if lid >= ahead_from:
            bucket = ahead
        else:
            bucket = passed_kept if kept and lid // per in kept else passed
        if len(bucket) < n:
            bucket.append(lid)
    for more in (passed_kept, ahead):
        while len(passed) < n and more:
            passed.append(more.popleft())
    return passed


def coldest(lru: Iterable[int], n: int, spare: Callable[[int], bool] | None = None) -> list[int]:
    """The `n` least recently used lids, passing over those `spare` keeps; coldest first."""
    victims = (lid for lid in lru if spare is None or not spare(lid))
    return list(itertools.islice(victims, max(n, 0)))  # coldest first
