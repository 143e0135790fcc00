"""Fills that land while the next step runs (policy direct): claimed at once in the host mirror,
the victims' table entries cleared at once, the new entries published only once the copies are
done (on the CPU: by the next publish_ready), and settled before anything reads the table as
the mirror has it."""

import random

import torch

from freetoken_agent.engine.experts.cache import ExpertCache
from freetoken_agent.engine.experts.pool import ExpertPool

L, E, H, I = 3, 8, 4, 2  # noqa: E741 - the shape legend's names


def _cache(seed: int, slots: int) -> ExpertCache:
    g = torch.Generator().manual_seed(seed)
    w13, w2 = torch.randn(L * E, 2 * I, H, generator=g), torch.randn(L * E, H, I, generator=g)
    pool = ExpertPool(w13, w2)
    return ExpertCache(pool, slots, torch.device("cpu"), lids_per_layer=E)


def _table(cache: ExpertCache) -> list[int]:
    return cache.slot_of.tolist()


def test_started_fills_publish_one_step_later_and_victims_at_once(rng_seed):
    rng = random.Random(rng_seed)
    slots = rng.randrange(2, L * E)
    cache = _cache(rng_seed, slots)
    cache.fill(rng.sample(range(L * E), slots), protect=set())  # a full cache: fills evict
    for _ in range(20):
        before = _table(cache)
        want = rng.sample(range(L * E), rng.randrange(1, L * E))
        # As after_step protects them: this step's experts, the misses wanted among them.
        protect = set(want) | set(rng.sample(range(L * E), rng.randrange(0, 4)))
        filled = cache.inflight.start(want, protect)
        assert set(filled) <= {lid for lid in want if before[lid] < 0}
        assert all(cache.resident(lid) for lid in protect if before[lid] >= 0), "evicted"
        table = _table(cache)
        for lid in filled:
            assert cache.resident(lid) and table[lid] == -1  # claimed, not yet on the device
            slot = cache._slot_of[lid]
            assert torch.equal(cache.w13[slot], cache.pool.w13[lid])
            assert torch.equal(cache.w2[slot], cache.pool.w2[lid])
        for lid, slot in enumerate(before):
            if slot >= 0 and not cache.resident(lid):
                assert table[lid] == -1, "a victim's entry still points at its old slot"
        cache.check_integrity()
        if rng.random() < 0.5:
            cache.inflight.publish_ready()
        else:
            cache.inflight.settle()
        assert not cache.inflight
        assert _table(cache) == cache._slot_of  # published: the table is the mirror
        cache.check_integrity()


def test_anything_reading_the_table_settles_first(rng_seed):
    rng = random.Random(rng_seed)
    cache = _cache(rng_seed, 3 * E)
    for settle in (
        lambda: cache.fill([rng.randrange(L * E)], protect=set()),
        lambda: (cache.lend(E), cache.take_back()),
        lambda: cache.resize(cache.first_slot),
        cache.reset,
    ):
        started = cache.inflight.start(rng.sample(range(L * E), 5), protect=set())
        assert cache.inflight or not started
        settle()
        assert not cache.inflight
        assert _table(cache) == cache._slot_of
        cache.check_integrity()
