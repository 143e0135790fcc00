"""Policy gpu-fill's handoff of the cache between host and device (engine/experts/device_fills.py):
a round trip with nothing in between keeps the host's LRU, free list and table; plans made on
the device come back as the same cache a host LRU would hold; kept layers are never victims."""

import random

import torch

from freetoken_agent.engine.experts.cache import ExpertCache
from freetoken_agent.engine.experts.pool import ExpertPool
from freetoken_agent.kernels.expert_fills import copy_fills, plan_fills


def _cache(rng: random.Random, layers: int, experts: int, slots: int) -> ExpertCache:
    n, i, h = layers * experts, 3, 4
    pool = ExpertPool(torch.randn(n, 2 * i, h), torch.randn(n, h, i))
    cache = ExpertCache(pool, slots, torch.device("cpu"), lids_per_layer=experts)
    for _ in range(rng.randrange(0, 3 * slots)):  # a used cache: fills, touches, evictions
        layer = rng.randrange(layers)
        lids = sorted(rng.sample(range(experts), rng.randrange(1, min(experts, 3) + 1)))
        lids = [layer * experts + e for e in lids]
        cache.touch(lids)
        cache.fill(lids, set(lids))
    return cache


def _mirror(cache: ExpertCache):
    return list(cache._lru), sorted(cache._free), list(cache._slot_of), cache.slot_of.tolist()


def _plan(cache: ExpertCache, layer: int, ids: list[int], experts: int) -> None:
    fills = cache.on_device
    rows = plan_fills(torch.tensor(ids, dtype=torch.int32), layer * experts, cache.slot_of,
                      fills.lid_of, fills.stamp, fills.state, fills.moves, len(ids))  # fmt: skip
    copy_fills(fills.state, fills.moves, cache.pool.w13, cache.pool.w2, cache.w13, cache.w2)
    for lid, row in zip(ids, rows.tolist(), strict=True):
        assert row < 0 or torch.equal(cache.w13[row], cache.pool.w13[layer * experts + lid])


def test_a_round_trip_keeps_the_mirror(rng_seed):
    rng = random.Random(rng_seed)
    for _ in range(5):
        cache = _cache(rng, rng.randrange(1, 4), rng.randrange(2, 7), rng.randrange(1, 12))
        before = _mirror(cache)
        cache.on_device.own()
        assert cache.on_device.owned
        cache.check_integrity()  # releases first
        assert not cache.on_device.owned
        assert _mirror(cache) == before


def test_device_plans_come_back_as_a_host_lru(rng_seed):
    """Visits planned on the device, then released: the host's table is the device's, its LRU
    runs in the order of the device's stamps (ties by slot), the free list holds the empty
    slots, and the host's next fill evicts the lid the device used least recently."""
    rng = random.Random(rng_seed)
    for _ in range(5):
        layers, experts = rng.randrange(2, 4), rng.randrange(2, 7)
        cache = _cache(rng, layers, experts, rng.randrange(experts, 3 * experts))
        fills = cache.on_device
        fills.own()
        for _ in range(rng.randrange(1, 20)):
            layer = rng.randrange(layers)
            ids = rng.sample(range(experts), rng.randrange(1, min(experts, 3) + 1))
            _plan(cache, layer, ids, experts)
        table, stamps = cache.slot_of.tolist(), fills.stamp.tolist()
        fills.release()
        assert cache._slot_of == table
        order = [(stamps[table[lid]], table[lid]) for lid in cache._lru]
        assert order == sorted(order)
        assert sorted(cache._free) == [s for s in range(cache.max_slots) if s not in table]
        cache.check_integrity()
        absent = [lid for lid in range(cache.pool.n_rows) if table[lid] < 0]
        if cache._free or not absent:
            continue
        coldest = next(iter(cache._lru))
        cache.fill([absent[0]], {absent[0]})
        assert not cache.resident(coldest) and cache.resident(absent[0])


def test_kept_layers_are_never_victims(rng_seed):
    rng = random.Random(rng_seed)
    experts = 4  # three layers
    cache = ExpertCache(ExpertPool(torch.randn(12, 6, 4), torch.randn(12, 4, 3)), 6,
                        torch.device("cpu"), lids_per_layer=experts)  # fmt: skip
    kept = [2 * experts + e for e in range(experts)]  # layer 2 whole
    cache.fill(kept, set(kept))
    cache.kept_layers = frozenset({2})
    cache.on_device.own()
    for _ in range(30):
        layer = rng.randrange(2)
        _plan(cache, layer, rng.sample(range(experts), 2), experts)
    cache.on_device.release()
    assert all(cache.resident(lid) for lid in kept)
    cache.check_integrity()
