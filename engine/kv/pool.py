"""The paged KV pool and its page allocator.

K and V live in two tensors [L, P, S, Hkv, D] (L attention layers, P pages of S tokens); a layer's
slice [P, S, Hkv, D] is contiguous, which is what the attention kernels read. Page 0 is never
handed out: padded rows of a captured CUDA graph write their K/V there, so padding can never
corrupt a live sequence.

On the elastic arena (engine/arena.py) k and v are views of its KV lanes: each layer's slice is
the same dense [P, S, Hkv, D] as here, over more pages than are backed (only ids below
`allocator.n_pages` are). The allocator hands out the lowest free ids first, so the high end of
the pool tends to be free when the arena moves KV bytes to experts.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

import torch

from freetoken_agent.engine.device_index import on_device

if TYPE_CHECKING:
    from freetoken_agent.engine.arena import ElasticArena

# L attention layers, P pages, S page size (tokens), Hkv kv heads, D head_dim

SCRATCH_PAGE = 0
COPY_GROUP = 64  # pages per indexed copy: its gather buffer is L * 64 pages (~50 MB at 30B shapes)


class OutOfPages(RuntimeError):
    pass


class PageAllocator:
    """Free ids among 1..P-1 (a min-heap: the lowest id goes first). Owns no tensors."""

    def __init__(self, n_pages: int) -> None:
        if n_pages < 2:
            raise ValueError(f"the KV pool needs at least 2 pages, got {n_pages}")
        self.n_pages = n_pages
        self._free: list[int] = list(range(1, n_pages))  # a heap (sorted is one)
        self._is_free = [False] + [True] * (n_pages - 1)

    @property
    def n_free(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        """Pages that can ever be handed out (all but the scratch page)."""
        return self.n_pages - 1

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} KV pages, {len(self._free)} free")
        pages = [heapq.heappop(self._free) for _ in range(n)]
        for p in pages:
            self._is_free[p] = False
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if p == SCRATCH_PAGE or not 0 <= p < self.n_pages or self._is_free[p]:
                raise AssertionError(f"double free of KV page {p}")
            self._is_free[p] = True
            heapq.heappush(self._free, p)

    def free_set(self) -> set[int]:
        return set(self._free)

    def busy_above(self, n: int) -> list[int]:
        """Ids >= n that are in use: what must migrate before `shrink(n)`."""
        return [p for p in range(max(n, 1), self.n_pages) if not self._is_free[p]]

    def grow(self, n_pages: int) -> None:
        """Ids [old n_pages, n_pages) become free."""
        if n_pages < self.n_pages:
            raise ValueError(f"grow to {n_pages} pages, fewer than {self.n_pages}")
        for p in range(self.n_pages, n_pages):
            heapq.heappush(self._free, p)
        self._is_free += [True] * (n_pages - self.n_pages)
        self.n_pages = n_pages

    def shrink(self, n_pages: int) -> None:
        """Drop ids >= n_pages; every one of them must be free (migrate busy pages first)."""
        if not 2 <= n_pages <= self.n_pages:
            raise ValueError(f"shrink to {n_pages} pages: outside [2, {self.n_pages}]")
        busy = self.busy_above(n_pages)
        if busy:
            raise RuntimeError(
                f"cannot shrink the KV pool to {n_pages} pages: page {busy[0]} is in use "
                f"({len(busy)} busy at or above {n_pages})"
            )
        self._free = [p for p in self._free if p < n_pages]
        heapq.heapify(self._free)
        del self._is_free[n_pages:]
        self.n_pages = n_pages

    def check_integrity(self) -> None:
        assert len(set(self._free)) == len(self._free), "duplicate pages in the free list"
        assert SCRATCH_PAGE not in self._free, "the scratch page was handed out"
        assert all(self._is_free[p] for p in self._free)
        assert sum(self._is_free) == len(self._free)
        assert len(self._is_free) == self.n_pages, "free map and page count disagree"
        assert all(0 < p < self.n_pages for p in self._free), "a free id outside the pool"
        assert all(
            self._free[i] <= self._free[c]
            for i in range(len(self._free))
            for c in (2 * i + 1, 2 * i + 2)
            if c < len(self._free)
        ), "free list is not a heap"


class KVPool:
    """K/V page storage for every attention layer."""

    def __init__(
        self,
        n_layers: int,
        n_pages: int,
        page_size: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        shape = (n_layers, n_pages, page_size, n_kv_heads, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.page_size = page_size
        self.allocator = PageAllocator(n_pages)
        self.arena: ElasticArena | None = None

    @classmethod
    def on_arena(cls, arena: ElasticArena) -> KVPool:
        """A pool whose k/v are the arena's views ([L, P_max, S, Hkv, D]; only ids below
        `allocator.n_pages` are valid); its page count follows the arena's boundary through
        `allocator.grow` / `allocator.shrink`, called by whoever moves the boundary."""
        pool = cls.__new__(cls)
        pool.k, pool.v = arena.k, arena.v
        pool.page_size = arena.kv_unit.page_size
        pool.allocator = PageAllocator(min(arena.initial_pages, arena.kv_pages))
        pool.arena = arena
        return pool

    @staticmethod
    def page_bytes(
        n_layers: int, page_size: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        itemsize = torch.tensor([], dtype=dtype).element_size()
        return 2 * n_layers * page_size * n_kv_heads * head_dim * itemsize

    @property
    def nbytes(self) -> int:
        if self.arena is not None:  # the views span the whole arena: count usable pages
            return self.allocator.n_pages * self.arena.kv_unit.nbytes
        return self.k.nbytes + self.v.nbytes

    def copy_prefix(self, src: int, dst: int, n_tokens: int) -> None:
        """Copy the first n_tokens of page src into page dst, every layer (copy-on-write of a
        partially matched page)."""
        self.k[:, dst, :n_tokens] = self.k[:, src, :n_tokens]
        self.v[:, dst, :n_tokens] = self.v[:, src, :n_tokens]

    def copy_page(self, src: int, dst: int) -> None:
        """Copy page src into page dst, every layer, K and V (migration of a busy page)."""
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]

    def copy_pages(self, moves: list[tuple[int, int]], group: int = COPY_GROUP) -> None:
        """Copy each page src into page dst (src, dst pairs; no dst is also a src), every layer,
        K and V, `group` pages per indexed copy: a shrinking elastic split migrates hundreds
        of pages, which one copy per page (two launches each) stalled a decode step for
        ~0.1 s on the device. Each group gathers its sources before writing, so the sources
        and destinations must be disjoint, as a vacate's are (above / below the new top)."""
        for i in range(0, len(moves), group):
            part = moves[i : i + group]
            src = on_device([s for s, _ in part], torch.long, self.k.device)
            dst = on_device([d for _, d in part], torch.long, self.k.device)
            self.k[:, dst] = self.k[:, src]  # [L, n, S, Hkv, D]
            self.v[:, dst] = self.v[:, src]
