"""Emptying the top of the KV pool so it can shrink (elastic memory, at a safe point).

The KV pool and the expert slots share one device arena (engine/arena.py): KV pages from the
low end, slots from the high end. Giving bytes to the slots means the pages above a limit must
be empty. Free ones simply leave; cached and request-held ones move to free ids below the
limit (a page copy each: K and V of every attention layer), their ids rewritten in the radix
tree and in every request's page list; when no free page is left below, the least recently
used unreferenced cached pages are evicted first, as for any allocation.
"""

from __future__ import annotations

from collections.abc import Iterable

from freetoken_agent.engine.kv.pool import PageAllocator
from freetoken_agent.engine.kv.radix import RadixCache


def vacate_pages(
    allocator: PageAllocator, radix: RadixCache, requests: Iterable, limit: int
) -> list[tuple[int, int]] | None:
    """Move every busy page id >= limit below it. Returns the (src, dst) page copies the caller
    must make before anything else runs, or None when the pages in use do not fit below
    `limit` (nothing was changed then, beyond evicting unreferenced cached pages)."""
    users = [r for r in requests if r.pages]

    def busy_above() -> tuple[dict, list[int], int]:
        tree = {n.page: n for n in radix._nodes()}
        busy = sorted(p for p in {*tree, *(p for r in users for p in r.pages)} if p >= limit)
        free_high = sum(1 for p in allocator.free_set() if p >= limit)
        return tree, busy, allocator.n_free - free_high

    tree, busy, free_below = busy_above()
    if free_below < len(busy):
        radix.evict(len(busy) - free_below)  # LRU leaves; some may be busy ones above limit
        tree, busy, free_below = busy_above()
        if free_below < len(busy):
            return None
    targets = allocator.alloc(len(busy))  # lowest ids first: all below `limit`
    assert all(t < limit for t in targets), "the page allocator handed out a high page"
    moves = dict(zip(busy, targets, strict=True))
    for page, node in tree.items():
        if page in moves:
            node.page = moves[page]
    for req in users:
        req.pages = [moves.get(p, p) for p in req.pages]
    allocator.free(list(moves))  # the old ids: their contents leave with the copies
    return list(moves.items())
