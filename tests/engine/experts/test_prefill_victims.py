"""A prefill chunk's fills evict the layers it has passed before the layers ahead
(ExpertCache._victims): a chunk touches nearly every expert of every layer, so plain LRU would
evict the experts it is about to use."""

import random

import torch

from freetoken_agent.engine.experts.cache import ExpertCache
from freetoken_agent.engine.experts.pool import ExpertPool

L, E, H, I = 5, 8, 4, 2  # noqa: E741 - the shape legend's names


def _cache(seed: int, slots: int) -> ExpertCache:
    g = torch.Generator().manual_seed(seed)
    w13, w2 = torch.randn(L * E, 2 * I, H, generator=g), torch.randn(L * E, H, I, generator=g)
    return ExpertCache(ExpertPool(w13, w2), slots, torch.device("cpu"), lids_per_layer=E)


def test_fills_evict_the_layers_passed_first_then_the_oldest_ahead(rng_seed):
    rng = random.Random(rng_seed)
    for _ in range(20):
        slots = rng.randrange(E, L * E - E)
        cache = _cache(rng_seed, slots)
        cache.fill(rng.sample(range(L * E), slots), protect=set())  # full: fills evict
        cache.touch(rng.sample(range(L * E), L * E))  # an arbitrary LRU order
        layer = rng.randrange(L)
        ahead_from = (layer + 1) * E
        own = range(layer * E, ahead_from)
        protect = {lid for lid in own if rng.random() < 0.6}
        want = [lid for lid in own if not cache.resident(lid) and rng.random() < 0.8]
        order = list(cache._lru)  # oldest first
        free = [lid for lid in order if lid not in protect]
        expected = ([lid for lid in free if lid < ahead_from] +
                    [lid for lid in free if lid >= ahead_from])[: len(want)]  # fmt: skip
        before = {lid for lid in range(L * E) if cache.resident(lid)}
        filled = cache.fill(want, protect, ahead_from=ahead_from)
        assert filled == want[: len(expected)]
        evicted = before - {lid for lid in range(L * E) if cache.resident(lid)}
        assert evicted == set(expected)
        assert all(cache.resident(lid) for lid in protect & before)
        for lid in filled:
            slot = cache._slot_of[lid]
            assert torch.equal(cache.w13[slot], cache.pool.w13[lid])
        cache.check_integrity()


def _chunk(cache: ExpertCache, passed_first: bool) -> int:
    """One prefill chunk touching every expert of every layer, every miss filled (policy
    transfer); returns its hits."""
    hits = 0
    for layer in range(L):
        uniq = list(range(layer * E, (layer + 1) * E))
        cache.touch(uniq)
        misses = [lid for lid in uniq if not cache.resident(lid)]
        hits += E - len(misses)
        ahead_from = (layer + 1) * E if passed_first else None
        cache.fill(misses, set(uniq), ahead_from=ahead_from)
    return hits


def test_a_chunk_keeps_the_hits_of_the_layers_ahead(rng_seed):
    """Plain LRU turns each fill of a layer into a miss of a layer ahead; evicting the layers
    passed keeps every layer's hits but the first's (whose fills find nothing passed)."""
    rng = random.Random(rng_seed)
    slots = rng.randrange(2 * E, (L - 1) * E)
    caches = {first: _cache(rng_seed, slots) for first in (True, False)}
    start = rng.sample(range(L * E), slots)
    for cache in caches.values():
        cache.fill(start, protect=set())
    hits = {}
    for first, cache in caches.items():
        _chunk(cache, first)  # the previous chunk: the LRU now runs in layer order
        resident = [sum(cache.resident(lid) for lid in range(j * E, (j + 1) * E))
                    for j in range(L)]  # fmt: skip
        hits[first] = _chunk(cache, first)
        cache.check_integrity()
        if first:
            # Layer 0's fills find nothing passed: they evict the oldest of the layers ahead.
            # From layer 1 on, each layer evicts those before it: no other hit is lost.
            lost = min(E - resident[0], sum(resident[1:]))
            assert hits[first] == sum(resident) - lost
    assert hits[True] > hits[False]
