"""The paged KV pool and its page allocator.

K and V live in two tensors [L, P, S, Hkv, D] (L attention layers, P pages of S tokens); a layer's
slice [P, S, Hkv, D] is contiguous, which is what the attention kernels read. Page 0 is never
handed out: padded rows of a captured CUDA graph write their K/V there, so padding can never
corrupt a live sequence.
"""

from __future__ import annotations

from collections import deque

import torch

# L attention layers, P pages, S page size (tokens), Hkv kv heads, D head_dim

SCRATCH_PAGE = 0


class OutOfPages(RuntimeError):
    pass


class PageAllocator:
    """Free-list of page ids 1..P-1. Owns no tensors, only the ids."""

    def __init__(self, n_pages: int) -> None:
        if n_pages < 2:
            raise ValueError(f"the KV pool needs at least 2 pages, got {n_pages}")
        self.n_pages = n_pages
        self._free: deque[int] = deque(range(1, n_pages))
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
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._is_free[p] = False
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if p == SCRATCH_PAGE or self._is_free[p]:
                raise AssertionError(f"double free of KV page {p}")
            self._is_free[p] = True
            self._free.append(p)

    def free_set(self) -> set[int]:
        return set(self._free)

    def check_integrity(self) -> None:
        assert len(set(self._free)) == len(self._free), "duplicate pages in the free list"
        assert SCRATCH_PAGE not in self._free, "the scratch page was handed out"
        assert all(self._is_free[p] for p in self._free)
        assert sum(self._is_free) == len(self._free)


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

    @staticmethod
    def page_bytes(
        n_layers: int, page_size: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        itemsize = torch.tensor([], dtype=dtype).element_size()
        return 2 * n_layers * page_size * n_kv_heads * head_dim * itemsize

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def copy_prefix(self, src: int, dst: int, n_tokens: int) -> None:
        """Copy the first n_tokens of page src into page dst, every layer (copy-on-write of a
        partially matched page)."""
        self.k[:, dst, :n_tokens] = self.k[:, src, :n_tokens]
        self.v[:, dst, :n_tokens] = self.v[:, src, :n_tokens]
