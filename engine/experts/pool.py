"""The CPU expert pool: every routed expert in host memory, the source of truth.

Banks are the FTW layout, `w13 [N, 2I, H]` and `w2 [N, H, I]` indexed by `lid`, so a slot fill is
one contiguous copy per bank and the CPU executor reads an expert as two contiguous blocks.

Pinning: host-to-device copies from pageable memory run at a fraction of PCIe speed (8 GB/s vs
55 GB/s measured on the H200 host), so the pool is page-locked when the OS allows. Allocating
pinned memory directly is slow (about 1.6 GB/s); registering an ordinary buffer with
`cudaHostRegister` is fast (about 11.5 GB/s), so the pool is filled first and registered after,
in chunks aligned to expert rows (a copy never straddles two registrations). A failure to pin
leaves the pool pageable with one warning: slower fills, same results.

Registration works on whole pages, so every page a bank touches must be the bank's alone: a
small pool from the heap shared its first and last pages with other tensors, and then (device,
tiny test models) a second pool's registration failed (error 712) and a copy of a neighbouring
ordinary tensor, half inside a registered page, failed with "invalid argument" and poisoned
graph captures. Banks are therefore allocated page-exclusive (`page_exclusive`), registration
chunks end on page boundaries, and a pool built from someone else's tensors is moved into
page-exclusive memory before it is registered.
"""

from __future__ import annotations

import contextlib
import logging
import math
import mmap

import torch

from freetoken_agent.engine.config import ModelSpec

log = logging.getLogger("freetoken.experts")

# N = L * E expert rows (lid), H hidden, I expert width

PIN_CHUNK_BYTES = 1 << 30
PAGE = mmap.PAGESIZE
# Registrations whose release had to wait, each with the banks it covers (kept alive: memory
# freed while still registered poisons the next allocation at its addresses).
_deferred: list[tuple[list[int], tuple[torch.Tensor, ...]]] = []


def page_exclusive(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous tensor whose pages hold nothing else: an anonymous mapping of
    its own. Its storage starts on the mapping's first page, as registration needs (torch's
    `is_pinned`, which the direct policy's kernels check, asks about the storage's start)."""
    nbytes = math.prod(shape) * dtype.itemsize
    mapping = mmap.mmap(-1, max(1, nbytes))  # the tensor holds the mapping alive
    return torch.frombuffer(mapping, dtype=torch.uint8)[:nbytes].view(dtype).view(shape)


def pin_rows_for(row_bytes: tuple[int, ...]) -> int:
    """Rows per registration: about PIN_CHUNK_BYTES, and a whole number of pages in every bank
    (two registrations sharing a page fail, error 712)."""
    step = math.lcm(*(PAGE // math.gcd(b, PAGE) for b in row_bytes))
    rows = max(1, PIN_CHUNK_BYTES // max(row_bytes))
    return -(-rows // step) * step


class ExpertPool:
    def __init__(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        assert w13.device.type == "cpu" and w2.device.type == "cpu", "the pool lives in host memory"
        assert w13.shape[0] == w2.shape[0] and w13.is_contiguous() and w2.is_contiguous()
        self.w13 = w13  # [N, 2I, H]
        self.w2 = w2  # [N, H, I]
        self.pinned = False
        self._registered: list[int] = []
        self._page_exclusive = False  # set by `empty`; else `pin` moves the banks first
        # Rows per page-locked registration, the same for both banks: a host-to-device copy
        # must stay inside one registration, so multi-expert copies split at multiples of it.
        self.pin_rows = pin_rows_for((w13[0].nbytes, w2[0].nbytes))
        # One expert's bytes in both banks. An attribute, not a property: it was two tensor
        # views per read, and fills and streamed layers read it per expert (~0.25 ms of every
        # offloaded decode step and ~60 ms of a long prefill turn on the device's host).
        self.expert_bytes = w13[0].nbytes + w2[0].nbytes

    @classmethod
    def empty(cls, spec: ModelSpec, dtype: torch.dtype) -> ExpertPool:
        n = spec.n_moe_layers * spec.n_experts
        h, i = spec.hidden_size, spec.moe_intermediate_size
        pool = cls(page_exclusive((n, 2 * i, h), dtype), page_exclusive((n, h, i), dtype))
        pool._page_exclusive = True
        return pool

    @property
    def n_rows(self) -> int:
        return self.w13.shape[0]

    @property
    def nbytes(self) -> int:
        return self.w13.nbytes + self.w2.nbytes

    def projection(self, layer: int, expert: int, proj: str, n_experts: int) -> torch.Tensor:
        row = layer * n_experts + expert
        i = self.w2.shape[2]
        views = {
            "gate": lambda: self.w13[row, :i],
            "up": lambda: self.w13[row, i:],
            "gate_up": lambda: self.w13[row],
            "down": lambda: self.w2[row],
        }
        if proj not in views:
            raise KeyError(f"unknown expert projection {proj!r}")
        return views[proj]()

    def pin(self) -> bool:
        """Page-lock the banks for fast, asynchronous host-to-device copies. Returns whether it
        worked; on failure the pool stays pageable and one warning says so."""
        if self.pinned or not torch.cuda.is_available():
            return self.pinned
        if not self._page_exclusive:  # tensors of unknown neighbours: one copy, at load
            self.w13, self.w2 = (_moved_page_exclusive(b) for b in (self.w13, self.w2))
            self._page_exclusive = True
        _unregister_deferred()
        cudart = torch.cuda.cudart()
        try:
            for bank in (self.w13, self.w2):
                for lo in range(0, bank.shape[0], self.pin_rows):
                    chunk = bank[lo : lo + self.pin_rows]
                    ptr, size = chunk.data_ptr(), chunk.nbytes
                    err = cudart.cudaHostRegister(ptr, size, 0)
                    if int(err) != 0:
                        raise RuntimeError(f"cudaHostRegister failed with error {int(err)}")
                    self._registered.append(ptr)
        except Exception as e:  # noqa: BLE001 - any pinning failure falls back to pageable
            self.unpin()
            log.warning(
                "could not pin the %.1f GB expert pool (%s); keeping it pageable: cache fills "
                "will be slower, results are the same",
                self.nbytes / 1e9,
                e,
            )
            return False
        self.pinned = True
        return True

    def unpin(self) -> None:
        if self._registered:
            _unregister(self._registered, (self.w13, self.w2))
        self._registered = []
        self.pinned = False

    def __del__(self) -> None:  # registrations must not outlive the memory they cover
        with contextlib.suppress(Exception):  # interpreter shutdown
            self.unpin()


def _moved_page_exclusive(bank: torch.Tensor) -> torch.Tensor:
    out = page_exclusive(tuple(bank.shape), bank.dtype)
    out.copy_(bank)
    return out


def _unregister(ptrs: list[int], banks: tuple[torch.Tensor, ...]) -> None:
    """Release registrations now, or, inside a graph capture (where the call is forbidden and
    would break the capture) or when the driver refuses, later, keeping `banks` alive till then."""
    if _capturing():
        _deferred.append((list(ptrs), banks))
        return
    refused = _released_now(ptrs)
    if refused:
        log.warning("%d pinned pool chunks could not be released yet; retrying later", len(refused))
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
