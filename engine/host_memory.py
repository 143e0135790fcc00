"""Page-locked host memory by registration: buffers the device copies from fast and reads
directly (the expert pool, experts/pool.py; a host embedding table, layers/embedding.py).

Allocating pinned memory directly is slow (about 1.6 GB/s on the H200 host) and torch's pinned
allocator rounds sizes up to a power of two; registering an ordinary buffer with
`cudaHostRegister` is fast (about 11.5 GB/s) and exact, so buffers are filled first and
registered after, in chunks.

Registration works on whole pages, so every page a buffer touches must be the buffer's alone: a
small pool from the heap shared its first and last pages with other tensors, and then (device,
tiny test models) a second pool's registration failed (error 712) and a copy of a neighbouring
ordinary tensor, half inside a registered page, failed with "invalid argument" and poisoned
graph captures. Buffers are therefore allocated page-exclusive (`page_exclusive`), registration
chunks end on page boundaries, and a buffer built from someone else's tensors is moved into
page-exclusive memory before it is registered.
"""

from __future__ import annotations

import contextlib
import logging
import math
import mmap
import os

import torch

log = logging.getLogger("freetoken.memory")

PIN_CHUNK_BYTES = 1 << 30
PAGE = mmap.PAGESIZE
# Registrations whose release had to wait, each with the buffers it covers (kept alive: memory
# freed while still registered poisons the next allocation at its addresses).
_deferred: list[tuple[list[int], tuple[torch.Tensor, ...]]] = []


def page_exclusive(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous tensor whose pages hold nothing else: an anonymous mapping of
    its own. Its storage starts on the mapping's first page, as registration needs (torch's
    `is_pinned`, which the direct policy's kernels check, asks about the storage's start).
    With FREETOKEN_HUGE_PAGES=1 the mapping asks for transparent huge pages (`huge_pages`)."""
    nbytes = math.prod(shape) * dtype.itemsize
    mapping = mmap.mmap(-1, max(1, nbytes))  # the tensor holds the mapping alive
    if huge_pages():
        advise_huge(mapping)
    return torch.frombuffer(mapping, dtype=torch.uint8)[:nbytes].view(dtype).view(shape)


def huge_pages() -> bool:
    """Whether host buffers ask for transparent huge pages (FREETOKEN_HUGE_PAGES=1). The CPU
    kernel streams an expert's 9.4 MB across ~2300 4 KB pages and DMA walks them too; whether
    2 MB pages read faster is for the device host to say (`bench cpu-experts --huge-pages`),
    so it is off by default."""
    return os.environ.get("FREETOKEN_HUGE_PAGES") == "1"


def advise_huge(mapping: mmap.mmap) -> None:
    """Ask the kernel for huge pages over `mapping` before anything touches it (a no-op where
    THP is off or the call does not exist)."""
    with contextlib.suppress(AttributeError, OSError, ValueError):
        mapping.madvise(mmap.MADV_HUGEPAGE)


def pin_rows_for(row_bytes: tuple[int, ...]) -> int:
    """Rows per registration: about PIN_CHUNK_BYTES, and a whole number of pages in every bank
    (two registrations sharing a page fail, error 712)."""
    step = math.lcm(*(PAGE // math.gcd(b, PAGE) for b in row_bytes))
    rows = max(1, PIN_CHUNK_BYTES // max(row_bytes))
    return -(-rows // step) * step


def register_rows(bank: torch.Tensor, rows_per: int, registered: list[int]) -> None:
    """Page-lock a page-exclusive `bank` in registrations of `rows_per` rows (`pin_rows_for`),
    appending each one's address to `registered` (so that the caller releases those made before
    a failure). Raises when the driver refuses one."""
    _unregister_deferred()
    cudart = torch.cuda.cudart()
    for lo in range(0, bank.shape[0], rows_per):
        chunk = bank[lo : lo + rows_per]
        ptr, size = chunk.data_ptr(), chunk.nbytes
        err = cudart.cudaHostRegister(ptr, size, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister failed with error {int(err)}")
        registered.append(ptr)


def moved_page_exclusive(bank: torch.Tensor) -> torch.Tensor:
    """A copy of `bank` in page-exclusive memory (`page_exclusive`), ready to register."""
    out = page_exclusive(tuple(bank.shape), bank.dtype)
    out.copy_(bank)
    return out


def release_registrations(ptrs: list[int], banks: tuple[torch.Tensor, ...]) -> None:
    """Release registrations now, or, inside a graph capture (where the call is forbidden and
    would break the capture) or when the driver refuses, later, keeping `banks` alive till then."""
    if _capturing():
        _deferred.append((list(ptrs), banks))
        return
    refused = _released_now(ptrs)
    if refused:
        log.warning("%d pinned host chunks could not be released yet; retrying later", len(refused))
        _deferred.append((refused, banks))


def _unregister_deferred() -> None:
    """Retry the releases that had to wait (before the next registration may reuse memory)."""
    if _capturing():
        return
    waiting = list(_deferred)
    _deferred.clear()
    for ptrs, banks in waiting:
        refused = _released_now(ptrs)
        if refused:
            _deferred.append((refused, banks))


def _released_now(ptrs: list[int]) -> list[int]:
    """Unregister `ptrs`; returns the ones the driver refused."""
    cudart = torch.cuda.cudart()
    return [ptr for ptr in ptrs if int(cudart.cudaHostUnregister(ptr)) != 0]


def _capturing() -> bool:
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()
