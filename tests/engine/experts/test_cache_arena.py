"""ExpertCache on the elastic arena: resize (grow / shrink with eviction and slot moves),
lend / take_back after resizes, tail_hits, and the layer streamer on lent arena slots.

Shape legend: N = L * E lids, H hidden, I expert width.
"""

import random

import pytest
import torch

from freetoken_agent.engine.arena import ElasticArena, KVUnit, SlotUnit
from freetoken_agent.engine.experts.cache import ExpertCache
from freetoken_agent.engine.experts.pool import ExpertPool
from freetoken_agent.engine.experts.streaming import LayerStreamer
from freetoken_agent.kernels.fused_moe import fused_moe

L, E, H, I = 4, 6, 8, 4  # noqa: E741
N = L * E


def make(seed: int, max_slots: int = 14, slots: int = 10):
    g = torch.Generator().manual_seed(seed)
    pool = ExpertPool(torch.randn(N, 2 * I, H, generator=g), torch.randn(N, H, I, generator=g))
    kv = KVUnit(1, 3, 1, 5, torch.float32)  # 120 bytes: divides neither way into a slot's 384
    slot = SlotUnit(H, I, torch.float32)
    arena = ElasticArena(max_slots * slot.nbytes + 7, "cpu", kv, slot)
    arena.slot_buffer.fill_(0xFF)  # NaN: a slot read before its fill shows up
    arena.set_boundary(arena.boundary_for(n_slots=slots))
    cache = ExpertCache(pool, 0, torch.device("cpu"), lids_per_layer=E, arena=arena)
    return pool, arena, cache


def check(cache: ExpertCache, pool: ExpertPool) -> None:
    cache.check_integrity()
    for lid, slot in enumerate(cache._slot_of):
        if slot >= 0:
            assert slot >= cache.first_slot
            assert torch.equal(cache.w13[slot], pool.w13[lid]), f"slot {slot} lost lid {lid}"
            assert torch.equal(cache.w2[slot], pool.w2[lid]), f"slot {slot} lost lid {lid}"


def test_resize_randomized(rng_seed):
    r = random.Random(rng_seed)
    pool, arena, cache = make(rng_seed)
    for _ in range(200):
        op = r.random()
        if op < 0.45:
            layer = r.randrange(L)
            lids = r.sample(range(layer * E, (layer + 1) * E), r.randint(1, 4))
            cache.touch(lids)
            cache.fill(lids, set(lids))
        elif op < 0.5:
            cache.tick()
        elif op < 0.75:  # shrink: the coldest go first
            first = r.randint(cache.first_slot, cache.max_slots - 2)
            keep = cache.max_slots - first
            lru = list(cache._lru)
            n_evict = max(0, len(lru) - keep)
            evicted = cache.resize(first)
            assert evicted == lru[:n_evict]
            assert all(cache.resident(lid) for lid in lru if lid not in evicted)
            assert list(cache._lru) == [lid for lid in lru if lid not in evicted]  # order kept
            arena.set_boundary(arena.boundary_for(n_slots=cache.n_slots))
            assert arena.first_slot == cache.first_slot
        else:
            first = r.randint(1, cache.first_slot) if cache.first_slot > 1 else 1
            assert cache.resize(first) == []
            arena.set_boundary(arena.boundary_for(n_slots=cache.n_slots))
        # the KV side scribbles over everything below first_slot after a move of the boundary
        arena.slot_buffer[: cache.first_slot * arena.slot_unit.nbytes].fill_(0xFF)
        check(cache, pool)
        if r.random() < 0.2:  # lend (experts in the lent slots move) and give back
            n = r.randint(1, max(1, cache.n_slots - 2))
            lru = list(cache._lru)
            keep = set(lru[max(0, len(lru) - (cache.n_slots - n)) :])  # the most recent that fit
            w13, w2 = cache.lend(n)
            assert w13.shape[0] == n and w13.data_ptr() == cache.w13[14 - n].data_ptr()
            assert set(cache._lru) == keep
            w13.normal_(), w2.normal_()  # scribbles over the lent slots only
            check(cache, pool)
            with pytest.raises(AssertionError, match="lent"):
                cache.resize(cache.first_slot)
            cache.take_back()
            check(cache, pool)


def test_resize_drops_races_of_evicted_fills(rng_seed):
    pool, _, cache = make(rng_seed, slots=3)
    cache.fill([0, 1, 2], set())
    cache.fill([E], set())  # evicts lid 0 (LRU): a race [E, 0, ...] waits on layers 1 and 0
    cache.touch([1, 2])  # settles layer 0's races; LRU: E, 1, 2
    assert any(r[0] == E for r in cache.races.pending[1])
    evicted = cache.resize(cache.max_slots - 1)
    assert evicted == [E, 1]
    assert all(r[0] not in evicted for races in cache.races.pending.values() for r in races)
    check(cache, pool)


def test_tail_hits(rng_seed):
    pool, _, cache = make(rng_seed, slots=8)
    cache.fill(list(range(6)), set())  # LRU: 0..5
    cache.tick()
    cache.touch([0, 1])  # hit at step 1; LRU: 2 3 4 5 0 1
    for _ in range(3):
        cache.tick()
    cache.touch([2])  # step 4; LRU: 3 4 5 0 1 2

    def tail_hits(k: int, window: int) -> float:  # hits/step lost by giving up k slots
        return cache.tail_profile(window)[k] / window

    assert tail_hits(3, 2) == 0.0  # 3, 4, 5 never hit
    assert tail_hits(5, 4) == 2 / 4  # 0 and 1, hit at step 1, within steps 1..4
    assert tail_hits(5, 3) == 0.0  # window of steps 2..4: neither 0 nor 1
    assert tail_hits(6, 1) == 1.0  # only lid 2, this step
    assert tail_hits(6, 10) == 3 / 10


def test_streamer_on_lent_arena_slots(rng_seed):
    pool, arena, cache = make(rng_seed, max_slots=16, slots=15)
    cache.resize(cache.max_slots - 15)
    cache.fill([1, E + 2, 3 * E], set())  # resident ones are read in their slots
    streamer = LayerStreamer(pool, cache, E, L, torch.device("cpu"), double_buffer=True, lend=True)
    g = torch.Generator().manual_seed(rng_seed)
    for layer in range(L):
        hidden = torch.randn(5, H, generator=g)  # [T, H]
        ids = torch.stack([torch.randperm(E, generator=g)[:3] for _ in range(5)]).int()
        weights = torch.rand(5, 3, generator=g)
        out = streamer.moe(layer, hidden, ids, weights)
        if layer < L - 1:  # the ring over lent slots: host copies into it are one DMA
            assert streamer.w13.is_contiguous() and streamer.w2.is_contiguous()
        rows = slice(layer * E, (layer + 1) * E)
        want = fused_moe(hidden, pool.w13[rows], pool.w2[rows], ids, weights)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    assert not cache.lent
    check(cache, pool)


def use_at_random(cache, pool, r: random.Random, steps: int) -> None:
    """`steps` steps of random hits and fills."""
    for _ in range(steps):
        cache.tick()
        lids = r.sample(range(pool.n_rows), r.randint(1, 4))
        cache.touch(lids)
        cache.fill([x for x in lids if not cache.resident(x)], set(lids))


def test_tail_profile_counts_recent_hits_of_the_coldest(rng_seed):
    r = random.Random(rng_seed)
    pool, _, cache = make(rng_seed, slots=8)
    use_at_random(cache, pool, r, 20)
    window = r.randint(1, 12)
    hot = cache.tail_profile(window)
    assert len(hot) == len(cache._lru) + 1 and hot[0] == 0
    coldest_first = list(cache._lru)
    for k in range(len(hot)):  # counted here from the LRU order and the last hits directly
        recent = sum(
            cache.clock.last_hit[lid] > cache.clock.step - window for lid in coldest_first[:k]
        )
        assert hot[k] == recent


def test_lent_arena_slots_are_contiguous_banks_over_exactly_their_bytes(rng_seed):
    """Lent slots come back as contiguous [n, 2I, H] / [n, H, I] banks (a host copy into them
    is one DMA, not a temporary and a strided kernel), covering the lent slots' bytes and
    nothing else: the slots below keep their experts."""
    r = random.Random(rng_seed)
    pool, arena, cache = make(rng_seed, max_slots=16, slots=15)
    cache.resize(cache.max_slots - 15)
    cache.fill(r.sample(range(pool.n_rows), 12), set())
    n = r.randint(1, 6)
    w13, w2 = cache.lend(n)
    assert w13.is_contiguous() and w2.is_contiguous()
    assert w13.shape == (n, 2 * I, H) and w2.shape == (n, H, I)
    lo = (16 - n) * arena.slot_unit.nbytes  # the lent slots' bytes in the slot range
    assert w13.data_ptr() == arena.slot_buffer.data_ptr() + lo
    assert w2.data_ptr() + w2.nbytes == arena.slot_buffer.data_ptr() + 16 * arena.slot_unit.nbytes
    a, b = torch.randn(w13.shape), torch.randn(w2.shape)
    w13.copy_(a), w2.copy_(b)
    assert torch.equal(w13, a) and torch.equal(w2, b)  # the two banks do not overlap
    for lid, slot in enumerate(cache._slot_of):  # the experts in service, untouched
        if slot >= 0:
            assert slot < 16 - n
            assert torch.equal(cache.w13[slot], pool.w13[lid])
            assert torch.equal(cache.w2[slot], pool.w2[lid])
    cache.take_back()
    check(cache, pool)


def test_lend_keeps_the_hottest_experts_and_evicts_the_coldest(rng_seed):
    """A lend evicts the n least recently used experts, wherever they live, and moves
    the lent slots' other experts below (content intact); the LRU order of the survivors is
    kept. Fills after a take_back go to the lowest free slot, the lent range's, so the top
    slots hold the freshest experts: evicting them had cost every prefill chunk those."""
    r = random.Random(rng_seed)
    pool, arena, cache = make(rng_seed, max_slots=16, slots=15)
    cache.resize(cache.max_slots - 15)
    cache.fill(r.sample(range(pool.n_rows), 15), set())
    cache.touch(r.sample(list(cache._lru), 6))  # some hits: a mixed LRU order
    n = r.randint(1, 14)
    order = list(cache._lru)
    coldest = order[: max(0, len(order) - (15 - n))]
    cache.lend(n)
    assert sorted(lid for lid in order if not cache.resident(lid)) == sorted(coldest)
    assert list(cache._lru) == [lid for lid in order if lid not in coldest]  # order kept
    assert all(slot < 16 - n for slot in cache._slot_of if slot >= 0)
    cache.check_integrity()
    cache.take_back()
    check(cache, pool)


@pytest.mark.gpu
def test_lend_on_cuda_moves_experts_before_the_streamer_writes(rng_seed):
    """On CUDA, with real streams: a lend's moves (copy stream) read the lent slots before a
    streamer's copy stream scribbles over them, and compute queued after the lend reads the
    moved experts. Large rows, so a missing wait would let the scribble win the race."""
    r = random.Random(rng_seed)
    h, i, e, layers = 512, 256, 8, 4  # 1.5 MiB a slot
    g = torch.Generator().manual_seed(rng_seed)
    n = layers * e
    pool = ExpertPool(torch.randn(n, 2 * i, h, generator=g), torch.randn(n, h, i, generator=g))
    pool.pin()
    slot = SlotUnit(h, i, torch.float32)
    arena = ElasticArena(20 * slot.nbytes, "cuda", KVUnit(1, 16, 1, 16, torch.float32), slot)
    arena.set_boundary(arena.boundary_for(n_slots=19))
    cache = ExpertCache(pool, 0, torch.device("cuda"), lids_per_layer=e, arena=arena)
    cache.resize(arena.first_slot)
    cache.fill(r.sample(range(n), cache.n_slots), set())
    cache.touch(r.sample(list(cache._lru), 8))
    lent = r.randint(4, 10)
    streamer = torch.cuda.Stream()
    w13, w2 = cache.lend(lent)
    streamer.wait_stream(torch.cuda.current_stream())  # as LayerStreamer.weights does
    with torch.cuda.stream(streamer):
        w13.fill_(float("nan")), w2.fill_(float("nan"))
    sums = {lid: (cache.w13[s].sum(), cache.w2[s].sum()) for lid, s in enumerate(cache._slot_of)
            if s >= 0}  # fmt: skip
    torch.cuda.synchronize()
    for lid, (a, b) in sums.items():
        assert torch.allclose(a.cpu(), pool.w13[lid].sum(), rtol=1e-4, atol=1e-2), lid
        assert torch.allclose(b.cpu(), pool.w2[lid].sum(), rtol=1e-4, atol=1e-2), lid
    cache.take_back()
    cache.check_integrity()


def test_an_owned_cache_profiles_its_mirror_until_it_is_too_old(rng_seed):
    """While the device owns the cache, the tail profile is the host mirror's as of the step
    the device took it (no hand-back: the policy asks ~every 16 decode steps), for up to
    `max_stale` steps; past that the cache is handed back and profiled now."""
    r = random.Random(rng_seed)
    pool, _, cache = make(rng_seed, slots=8)
    use_at_random(cache, pool, r, 12)
    window = r.randint(2, 6)
    want = cache.tail_profile(window)
    fills = cache.on_device
    fills.own()
    stale = r.randint(1, 10)
    for _ in range(stale):
        cache.tick()  # steps on the device: the mirror ages, its window does not
    got = cache.tail_profile(window, max_stale=stale)
    assert fills.owned and fills.releases == 0 and (got == want).all()
    cache.tick()
    later = cache.tail_profile(window, max_stale=stale)  # too old: handed back first
    assert not fills.owned and fills.releases == 1 and cache.clock.mirror_step == cache.clock.step
    assert later.sum() <= want.sum()  # profiled now: the window moved past older hits
