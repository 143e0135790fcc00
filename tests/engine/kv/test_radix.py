"""Radix prefix cache: token-granular matching, reference counts, LRU eviction, integrity."""

from __future__ import annotations

import random

from freetoken_agent.engine.kv.pool import PageAllocator
from freetoken_agent.engine.kv.radix import RadixCache

S = 4


def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _cache_sequence(cache: RadixCache, alloc: PageAllocator, tokens: list[int]) -> None:
    """What the scheduler does for a finished request that reused nothing."""
    pages = alloc.alloc(-(-len(tokens) // S))
    nodes = cache.insert(tokens, pages, [None] * len(pages))
    cache.unlock([n for n in nodes if n is not None])
    alloc.free([p for p, n in zip(pages, nodes, strict=True) if n is None or n.page != p])


def test_match_is_longest_common_prefix(rng_seed):
    rng = random.Random(rng_seed)
    alloc = PageAllocator(4096)
    cache = RadixCache(S, alloc)
    base = [rng.randrange(5) for _ in range(40)]
    seqs = []
    for _ in range(30):
        cut = rng.randrange(len(base))
        seq = base[:cut] + [rng.randrange(5) for _ in range(rng.randrange(1, 20))]
        _cache_sequence(cache, alloc, seq)
        seqs.append(seq)
        cache.check_integrity()
    for _ in range(200):
        cut = rng.randrange(len(base) + 1)
        query = base[:cut] + [rng.randrange(5) for _ in range(rng.randrange(0, 10))]
        expected = max(_lcp(query, s) for s in seqs)
        match = cache.match(query)
        assert match.n_tokens(S) == expected
        assert all(len(n.tokens) == S for n in match.nodes)
        assert match.partial_tokens < S


def test_locked_nodes_survive_eviction_and_lru_order(rng_seed):
    rng = random.Random(rng_seed)
    alloc = PageAllocator(64)
    cache = RadixCache(S, alloc)
    a = [rng.randrange(100) for _ in range(8 * S)]
    b = [rng.randrange(100, 200) for _ in range(8 * S)]
    _cache_sequence(cache, alloc, a)
    _cache_sequence(cache, alloc, b)
    held = cache.match(a)
    cache.lock(held.nodes)
    cache.match(b)  # touch b after a: a is older, but locked
    assert cache.evict(100) == 8  # all of b, none of a
    cache.check_integrity()
    assert cache.match(b).n_tokens(S) == 0
    assert cache.match(a).n_tokens(S) == len(a)
    cache.unlock(held.nodes)
    assert cache.evict(3) == 3  # leaves first: the tail of a
    assert cache.match(a).n_tokens(S) == len(a) - 3 * S
    assert alloc.n_free + cache.n_pages == alloc.capacity
    cache.check_integrity()


def test_duplicate_pages_stay_private():
    alloc = PageAllocator(16)
    cache = RadixCache(S, alloc)
    seq = list(range(10))
    _cache_sequence(cache, alloc, seq)
    used = cache.n_pages
    _cache_sequence(cache, alloc, seq)  # same tokens again: no new nodes, pages freed
    assert cache.n_pages == used
    assert alloc.n_free + cache.n_pages == alloc.capacity
    cache.check_integrity()


def test_cached_pages_of_looks_without_using(rng_seed):
    rng = random.Random(rng_seed)
    alloc = PageAllocator(1024)
    cache = RadixCache(S, alloc)
    seq = [rng.randrange(5) for _ in range(rng.randint(9, 40))]
    _cache_sequence(cache, alloc, seq)
    clock, version = cache.clock, cache.version
    cut = rng.randrange(len(seq))
    probe = seq[:cut] + [5] * rng.randint(0, 9)  # token 5 never occurs in seq
    assert len(cache.cached_pages_of(probe)) == cut // S
    path = cache.cached_pages_of(seq)
    assert len(path) == len(seq) // S
    assert [n.tokens for n in path] == [tuple(seq[i * S : (i + 1) * S]) for i in range(len(path))]
    assert (cache.clock, cache.version) == (clock, version)  # no use recorded


class _Ckpt:
    """What the tree reads of a checkpoint: its boundary, and the owner it sets."""

    def __init__(self, boundary: int) -> None:
        self.boundary, self.owner = boundary, None


def test_a_hung_checkpoint_is_linked_to_the_deepest_one_above_it_on_its_path(rng_seed):
    """attach_checkpoint tells the pool (link_checkpoint) the deepest live checkpoint before
    the new one's boundary on the path to its node: a shallower one on the same node, else an
    ancestor's deepest; never one on another branch. Checked against the path's nodes."""
    rng = random.Random(rng_seed)
    alloc = PageAllocator(4096)
    cache = RadixCache(S, alloc)
    links: list[tuple[_Ckpt, _Ckpt | None]] = []
    cache.link_checkpoint = lambda ckpt, prev: links.append((ckpt, prev))
    base = [rng.randrange(5) for _ in range(60)]
    seqs = []
    for _ in range(12):
        seq = base[: rng.randrange(len(base))] + [rng.randrange(5, 9) for _ in range(30)]
        _cache_sequence(cache, alloc, seq)
        seqs.append(seq)
    hung: list[_Ckpt] = []
    for _ in range(120):
        seq = rng.choice(seqs)
        boundary = rng.randrange(1, len(seq) + 1)
        ckpt = _Ckpt(boundary)
        if not cache.attach_checkpoint(seq, boundary, ckpt):
            continue
        node = ckpt.owner
        path, walk = set(), node
        while walk is not None:
            path.add(id(walk))
            walk = walk.parent
        above = [c for c in hung if id(c.owner) in path and c.boundary < boundary]
        want = max(above, key=lambda c: c.boundary, default=None)
        assert links[-1] == (ckpt, want)
        hung.append(ckpt)
        if rng.random() < 0.2:  # the pool drops one now and then
            gone = rng.choice(hung)
            cache.forget_checkpoint(gone)
            hung.remove(gone)
    assert sum(1 for _, prev in links if prev is not None) > 10, "nothing was linked: no test"
    cache.check_integrity()
