"""The elastic arena: views touch exactly their bytes, boundary math, allocator grow/shrink,
KVPool on the arena.

Shape legend: L layers, P pages, S page size, Hkv kv heads, D head_dim, H hidden, I expert width.
"""

import random

import pytest
import torch

from freetoken_agent.engine.arena import ElasticArena, KVUnit, SlotUnit
from freetoken_agent.engine.kv.pool import KVPool, PageAllocator

POISON = 0xA5


def make_arena(seed: int, dtype=torch.float32, slots=True, extra=0) -> ElasticArena:
    """Odd sizes: neither unit divides the other, and a tail below either unit."""
    r = random.Random(seed)
    kv = KVUnit(r.randint(1, 3), r.choice([2, 3, 4]), r.randint(1, 2), r.choice([3, 4, 5]), dtype)
    slot = SlotUnit(r.choice([5, 6, 7]), r.choice([3, 4]), dtype) if slots else None
    nbytes = 7 * kv.nbytes + (9 * slot.nbytes if slots else 0) + extra + r.randint(1, 13)
    arena = ElasticArena(nbytes, "cpu", kv, slot)
    arena.kv_buffer.fill_(POISON)
    if slots:
        arena.slot_buffer.fill_(POISON)
    return arena


def _only_changed(after: torch.Tensor, before: torch.Tensor, lo: int, hi: int) -> None:
    """Bytes outside [lo, hi) are unchanged; some inside changed (the write landed there)."""
    assert torch.equal(after[:lo], before[:lo]) and torch.equal(after[hi:], before[hi:])
    assert not torch.equal(after[lo:hi], before[lo:hi])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kv_views_touch_exactly_their_bytes(rng_seed, dtype):
    arena = make_arena(rng_seed, dtype)
    u = arena.kv_unit
    g = torch.Generator().manual_seed(rng_seed)
    layer_bytes = u.layer_elems * dtype.itemsize
    for _ in range(6):
        p = int(torch.randint(arena.max_pages, (1,), generator=g))
        layer = int(torch.randint(u.n_layers, (1,), generator=g))
        for which, view in ((0, arena.k), (1, arena.v)):
            before = arena.kv_buffer.clone()
            data = torch.randn(view.shape[2:], generator=g).to(dtype)  # [S, Hkv, D]
            view[layer][p] = data
            # layer's lane (K lanes, then V lanes), then page p within it
            lo = (which * u.n_layers + layer) * arena.lane_bytes + p * layer_bytes
            _only_changed(arena.kv_buffer, before, lo, lo + layer_bytes)
            assert torch.equal(view[layer, p], data)
    # A layer's pages are dense, as in a fixed pool: what the attention kernels read.
    assert arena.k[0].is_contiguous() and arena.v[u.n_layers - 1].is_contiguous()
    assert arena.k.stride(0) * dtype.itemsize == arena.lane_bytes >= arena.max_pages * layer_bytes


def test_slot_views_touch_exactly_their_bytes(rng_seed):
    arena = make_arena(rng_seed)
    u = arena.slot_unit
    g = torch.Generator().manual_seed(rng_seed)
    w13_bytes = 2 * u.inter * u.hidden * 4
    for s in torch.randperm(arena.max_slots, generator=g)[:4].tolist():
        before = arena.slot_buffer.clone()
        arena.w13[s] = torch.randn(2 * u.inter, u.hidden, generator=g)
        _only_changed(arena.slot_buffer, before, s * u.nbytes, s * u.nbytes + w13_bytes)
        before = arena.slot_buffer.clone()
        arena.w2[s] = torch.randn(u.hidden, u.inter, generator=g)
        _only_changed(arena.slot_buffer, before, s * u.nbytes + w13_bytes, (s + 1) * u.nbytes)
    assert arena.w13.stride(0) == arena.w2.stride(0) == u.elems
    assert arena.w13[0].is_contiguous() and arena.w2[0].is_contiguous()


def test_boundary_math_at_odd_sizes(rng_seed):
    arena = make_arena(rng_seed)
    ukv, us = arena.kv_unit.nbytes, arena.slot_unit.nbytes
    assert arena.max_pages == arena.nbytes // ukv and arena.max_slots == arena.nbytes // us
    r = random.Random(rng_seed)
    for _ in range(50):
        b = r.randint(2 * ukv, arena.nbytes)
        arena.set_boundary(b)
        arena.check_integrity()
        assert arena.kv_pages == b // ukv and arena.kv_bytes == arena.kv_pages * ukv <= b
        assert arena.first_slot == min(-(-b // us), arena.max_slots)
        assert arena.first_slot * us >= b or arena.n_slots == 0
        assert arena.slot_bytes == arena.n_slots * us
        # pages and slots never overlap
        assert arena.kv_pages * ukv <= max(arena.first_slot * us, b)
    for n in range(0, arena.max_slots + 1):
        b = arena.boundary_for(n_slots=n)
        if b // ukv < 2:
            with pytest.raises(ValueError):
                arena.set_boundary(b)
            continue
        arena.set_boundary(b)
        assert arena.n_slots == n
        if n:  # the largest such boundary: one byte more loses a slot
            arena.set_boundary(b + 1)
            assert arena.n_slots == n - 1
    for p in range(2, arena.max_pages + 1):
        arena.set_boundary(arena.boundary_for(kv_pages=p))
        assert arena.kv_pages == p
    for bad in (0, arena.nbytes + 1, 2 * ukv - 1):
        with pytest.raises(ValueError):
            arena.set_boundary(bad)


def test_arena_without_slots_is_a_kv_region(rng_seed):
    arena = make_arena(rng_seed, slots=False)
    assert arena.n_slots == 0 and arena.slot_bytes == 0 and arena.w13 is None
    arena.set_boundary(arena.boundary_for(kv_pages=3))
    assert arena.kv_pages == 3
    arena.check_integrity()


def test_allocator_lowest_first_grow_shrink(rng_seed):
    r = random.Random(rng_seed)
    a = PageAllocator(10)
    got = a.alloc(4)
    assert got == [1, 2, 3, 4]
    a.free([2, 4])
    assert a.alloc(1) == [2]  # lowest free first
    a.check_integrity()
    with pytest.raises(RuntimeError, match="page 3 is in use"):
        a.shrink(3)  # 1, 2, 3 held
    busy = a.alloc(6)  # 4..9
    assert busy == [4, 5, 6, 7, 8, 9]
    assert a.busy_above(7) == [7, 8, 9]
    with pytest.raises(RuntimeError, match="page 7 is in use"):
        a.shrink(7)
    a.free([7, 8, 9])
    a.shrink(7)
    assert a.n_pages == 7 and a.n_free == 0
    a.check_integrity()
    a.grow(12)
    assert a.n_free == 5 and a.alloc(2) == [7, 8]
    a.check_integrity()
    # randomized: the free set always equals the complement of what is held
    held = set(range(1, 12)) - a.free_set()
    for _ in range(300):
        op = r.random()
        if op < 0.4 and a.n_free:
            n = r.randint(1, a.n_free)
            got = a.alloc(n)
            assert got == sorted(a.free_set() | set(got))[:n]  # the n lowest
            held |= set(got)
        elif op < 0.7 and held:
            out = r.sample(sorted(held), r.randint(1, len(held)))
            a.free(out)
            held -= set(out)
        elif op < 0.85:
            a.grow(a.n_pages + r.randint(0, 3))
        else:
            n = r.randint(2, a.n_pages)
            if any(p >= n for p in held):
                with pytest.raises(RuntimeError):
                    a.shrink(n)
            else:
                a.shrink(n)
        a.check_integrity()
        assert a.free_set() == set(range(1, a.n_pages)) - held


def test_kv_pool_on_arena_copy_page(rng_seed):
    arena = make_arena(rng_seed)
    arena.set_boundary(arena.boundary_for(kv_pages=5))
    pool = KVPool.on_arena(arena)
    assert pool.allocator.n_pages == 5 and pool.nbytes == arena.kv_bytes
    g = torch.Generator().manual_seed(rng_seed)
    pool.k[:, :5] = torch.randn(pool.k[:, :5].shape, generator=g)
    pool.v[:, :5] = torch.randn(pool.v[:, :5].shape, generator=g)
    k_before, v_before, raw = pool.k.clone(), pool.v.clone(), arena.slot_buffer.clone()
    pool.copy_page(3, 1)
    assert torch.equal(pool.k[:, 1], k_before[:, 3]) and torch.equal(pool.v[:, 1], v_before[:, 3])
    for p in (0, 2, 3, 4):
        assert torch.equal(pool.k[:, p], k_before[:, p]) and torch.equal(
            pool.v[:, p], v_before[:, p]
        )
    assert torch.equal(arena.slot_buffer, raw)  # the slots untouched
    pool.copy_prefix(4, 2, 1)
    assert torch.equal(pool.k[:, 2, :1], k_before[:, 4, :1])
    assert torch.equal(pool.v[:, 2, 1:], v_before[:, 2, 1:])
    # standalone pools copy pages too
    alone = KVPool(2, 4, 3, 1, 2, torch.float32, "cpu")
    alone.k.normal_(generator=g), alone.v.normal_(generator=g)
    k0 = alone.k.clone()
    alone.copy_page(1, 3)
    assert torch.equal(alone.k[:, 3], k0[:, 1]) and torch.equal(alone.k[:, 1], k0[:, 1])


def test_kv_pool_on_arena_copies_pages_in_groups(rng_seed):
    """copy_pages (a vacate's migration, grouped) moves what copy_page would, page by page,
    touching no other page and no slot, whatever the group size."""
    rng = random.Random(rng_seed)
    arena = make_arena(rng_seed)
    n = 7  # what make_arena holds
    arena.set_boundary(arena.boundary_for(kv_pages=n))
    pool = KVPool.on_arena(arena)
    g = torch.Generator().manual_seed(rng_seed)
    pool.k[:, :n] = torch.randn(pool.k[:, :n].shape, generator=g)
    pool.v[:, :n] = torch.randn(pool.v[:, :n].shape, generator=g)
    k0, v0, raw = pool.k[:, :n].clone(), pool.v[:, :n].clone(), arena.slot_buffer.clone()
    limit = rng.randrange(n // 2, n)  # sources above, destinations below: as vacate_pages
    k = rng.randrange(1, min(n - limit, limit - 1) + 1)
    moves = list(zip(rng.sample(range(limit, n), k), rng.sample(range(1, limit), k), strict=True))
    pool.copy_pages(moves, group=rng.randrange(1, 4))
    expect_k, expect_v = k0.clone(), v0.clone()
    for s, d in moves:
        expect_k[:, d], expect_v[:, d] = k0[:, s], v0[:, s]
    assert torch.equal(pool.k[:, :n], expect_k) and torch.equal(pool.v[:, :n], expect_v)
    assert torch.equal(arena.slot_buffer, raw)
