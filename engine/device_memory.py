"""Backing memory for the elastic arena: address ranges backed only where in use.

The arena (engine/arena.py) reserves its ranges of device addresses once, at the ceiling's
size: KV lanes (one per layer and K/V) and expert slots. Only what the split uses is backed by
memory; when the budget shrinks, what pages and slots gave up must leave this process for
another program to get it. CUDA's virtual memory API does exactly that without moving
anything: reserve the addresses, back them with physical chunks (cuMemCreate + cuMemMap), and
unmap and release chunks nothing uses (cuMemUnmap + cuMemRelease). Addresses never change, so
tensor views, kernel pointers and captured CUDA graphs stay valid. vLLM's sleep mode and
PyTorch's expandable segments use the same API.

Three backings, one interface (`view`, `map`, `unmap`, `releasable`, `mapped_bytes`):
- `VirtualMemory`: CUDA, the driver API through ctypes (libcuda ships with every driver; no
  build step). Chunks of `chunk_bytes` (a multiple of the allocation granularity, 2 MiB).
- `SimulatedMemory`: the CPU stand-in for a GPU with a budget (tests, --cpu-smoke). One real
  tensor; "unmapped" chunks are scribbled with 0xFF, so any read of a released byte corrupts
  results and the exactness tests fail, as a GPU would fault.
- `PlainMemory`: CUDA without the virtual memory API (a driver refusing it): one allocation,
  nothing is ever released; `mapped_bytes` stays the whole arena, so the budget watcher sees
  that shrinking gave nothing back.

A chunk is mapped when any byte of it is in use; `unmap(lo, hi)` releases only the chunks
wholly inside [lo, hi). Callers synchronise the device before unmapping (work in flight may
still read the old slots of moved experts).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import logging
from bisect import bisect_left

import torch

log = logging.getLogger(__name__)

CHUNK_BYTES = 32 << 20  # release/map granularity: 1/32 of a GiB, ~1,000 handles for 32 GB
# KV lanes (engine/arena.py) map in the driver's granularity: each of the 2L lanes rounds up to
# a chunk, so a larger chunk would strand up to 2L of them (3 GB at 32 MiB for 48 layers).
KV_CHUNK_BYTES = 2 << 20


class ChunkedMemory:
    """`nbytes` of addresses split in chunks, each mapped (backed) or not. The mapped chunk ids
    are kept sorted, so the questions asked at every split move (is anything in this range
    mapped, is all of it) cost a bisection, not a walk: at a ceiling of 140 GB the KV lanes
    alone have 70,000 chunks of 2 MiB."""

    def __init__(self, nbytes: int, chunk_bytes: int) -> None:
        self.nbytes, self.chunk = nbytes, chunk_bytes
        self.n_chunks = -(-nbytes // chunk_bytes)
        self._mapped: list[int] = []  # sorted ids of the mapped chunks
        self._kept: set[int] = set()  # mapped for good: unmap skips them (see keep)

    def view(self) -> torch.Tensor:
        """[nbytes] uint8 over the whole range (only mapped chunks may be touched)."""
        raise NotImplementedError

    @property
    def mapped(self) -> list[bool]:
        """Per chunk, whether it is mapped (for tests and debugging: O(n_chunks))."""
        flags = [False] * self.n_chunks
        for c in self._mapped:
            flags[c] = True
        return flags

    @property
    def mapped_bytes(self) -> int:
        return len(self._mapped) * self.chunk

    @property
    def releases(self) -> bool:
        """Whether unmapping gives memory back (False: PlainMemory)."""
        return True

    def _ids(self, first: int, end: int) -> list[int]:
        """The mapped chunk ids in [first, end)."""
        i, j = bisect_left(self._mapped, first), bisect_left(self._mapped, end)
        return self._mapped[i:j]

    def map(self, lo: int, hi: int) -> bool:
        """Back every chunk touching [lo, hi). False when the device is out of memory (the
        chunks mapped before the failure stay mapped; the caller must not use [lo, hi))."""
        first, end = lo // self.chunk, -(-hi // self.chunk)
        if end <= first or len(self._ids(first, end)) == end - first:
            return True
        for c in range(first, end):
            i = bisect_left(self._mapped, c)
            if i == len(self._mapped) or self._mapped[i] != c:
                if not self._map_chunk(c):
                    return False
                self._mapped.insert(i, c)
        return True

    def keep(self, offset: int) -> bool:
        """Map the chunk holding byte `offset` for good. Kernel launchers check the base pointer
        of every tensor they get (Triton asks the driver for its attributes and refuses an
        unmapped address), so the chunk under a view's first element must stay mapped even when
        the rows there are not in use. False when the device is out of memory."""
        if not self.map(offset, offset + 1):
            return False
        self._kept.add(offset // self.chunk)
        return True

    def unmap(self, lo: int, hi: int) -> int:
        """Release every chunk wholly inside [lo, hi), except kept ones; returns the bytes
        released."""
        first, end = -(-lo // self.chunk), hi // self.chunk
        ids = [c for c in self._ids(first, end) if c not in self._kept]
        for c in ids:
            self._unmap_chunk(c)
        if ids:
            i, j = bisect_left(self._mapped, first), bisect_left(self._mapped, end)
            self._mapped[i:j] = [c for c in self._mapped[i:j] if c in self._kept]
        return len(ids) * self.chunk

    def releasable(self, lo: int, hi: int) -> bool:
        """Whether unmap(lo, hi) would release anything."""
        ids = self._ids(-(-lo // self.chunk), hi // self.chunk)
        return len(ids) > len(self._kept) or any(c not in self._kept for c in ids)

    def is_mapped(self, lo: int, hi: int) -> bool:
        first, end = lo // self.chunk, -(-hi // self.chunk)
        return len(self._ids(first, end)) == max(0, end - first)

    def _span(self, c: int) -> tuple[int, int]:
        return c * self.chunk, min((c + 1) * self.chunk, self.nbytes)

    def _map_chunk(self, c: int) -> bool:
        raise NotImplementedError

    def _unmap_chunk(self, c: int) -> None:
        raise NotImplementedError


class SimulatedMemory(ChunkedMemory):
    """One host (or device) tensor; an unmapped chunk is scribbled (0xFF: NaN in bf16/fp16/
    fp32), so reading released memory shows in the results instead of passing silently."""

    def __init__(self, nbytes: int, device: torch.device, chunk_bytes: int) -> None:
        super().__init__(nbytes, chunk_bytes)
        self.tensor = torch.full((nbytes,), 0xFF, dtype=torch.uint8, device=device)

    def view(self) -> torch.Tensor:
        return self.tensor

    def _map_chunk(self, c: int) -> bool:
        return True  # the bytes keep their scribble until written, as fresh memory is undefined

    def _unmap_chunk(self, c: int) -> None:
        lo, hi = self._span(c)
        self.tensor[lo:hi].fill_(0xFF)


class PlainMemory(ChunkedMemory):
    """One ordinary allocation: always mapped, never released."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        super().__init__(nbytes, max(nbytes, 1))
        self.tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self._mapped = [0]

    def view(self) -> torch.Tensor:
        return self.tensor

    @property
    def releases(self) -> bool:
        return False

    def map(self, lo: int, hi: int) -> bool:
        return True

    def releasable(self, lo: int, hi: int) -> bool:
        return False

    def unmap(self, lo: int, hi: int) -> int:
        return 0


# --- CUDA virtual memory through the driver API -------------------------------------------
class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class _AllocationProp(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [
        ("type", ctypes.c_int),  # CU_MEM_ALLOCATION_TYPE_PINNED = 1
        ("requestedHandleTypes", ctypes.c_int),  # CU_MEM_HANDLE_TYPE_NONE = 0
        ("location", _Location),  # CU_MEM_LOCATION_TYPE_DEVICE = 1, device ordinal
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _AllocFlags),
    ]


class _AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]  # READWRITE = 3


CUDA_ERROR_OUT_OF_MEMORY = 2
_driver: ctypes.CDLL | None = None


def _libcuda() -> ctypes.CDLL:
    global _driver
    if _driver is None:
        name = ctypes.util.find_library("cuda") or "libcuda.so.1"
        _driver = ctypes.CDLL(name)
    return _driver


def _check(result: int, what: str) -> None:
    if result != 0:
        text = ctypes.c_char_p()
        _libcuda().cuGetErrorString(result, ctypes.byref(text))
        message = text.value.decode() if text.value else "unknown error"
        raise RuntimeError(f"{what} failed: CUDA error {result} ({message})")


class _ArrayInterface:
    """What torch.as_tensor needs to wrap raw device memory (no copy, no ownership)."""

    def __init__(self, ptr: int, nbytes: int, owner: object) -> None:
        self.owner = owner  # torch keeps this object while the tensor lives: so the memory
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
            "stream": None,  # no synchronisation: nothing was written
        }


class VirtualMemory(ChunkedMemory):
    """A reserved range of device addresses, chunks mapped and released on demand."""

    def __init__(self, nbytes: int, device: torch.device, chunk_bytes: int) -> None:
        cu = _libcuda()
        self.device = device
        index = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.synchronize(index)  # the runtime made the primary context current here
        self._prop = _AllocationProp(type=1, requestedHandleTypes=0)
        self._prop.location = _Location(1, index)
        granularity = ctypes.c_size_t()
        _check(cu.cuMemGetAllocationGranularity(ctypes.byref(granularity),
                                                ctypes.byref(self._prop), 0),  # fmt: skip
               "cuMemGetAllocationGranularity")  # fmt: skip
        g = granularity.value
        chunk = -(-chunk_bytes // g) * g
        super().__init__(nbytes, chunk)
        self._access = _AccessDesc(_Location(1, index), 3)
        self._reserved = self.n_chunks * chunk
        base = ctypes.c_uint64()
        _check(cu.cuMemAddressReserve(ctypes.byref(base), ctypes.c_size_t(self._reserved),
                                      ctypes.c_size_t(g), ctypes.c_uint64(0),
                                      ctypes.c_ulonglong(0)),  # fmt: skip
               "cuMemAddressReserve")  # fmt: skip
        self.base = base.value
        self._handles: list[int | None] = [None] * self.n_chunks
        # The first chunk is mapped so that torch can read the pointer's attributes (its
        # device) when the view is made.
        if not self.map(0, 1):
            self.close()
            raise torch.cuda.OutOfMemoryError("no device memory for the arena's first chunk")

    def view(self) -> torch.Tensor:
        """A tensor over the range. It keeps this object alive (the interface holds it and
        torch holds the interface), so the memory outlives every view; this object never
        holds the tensor, or the two would keep each other forever."""
        return torch.as_tensor(_ArrayInterface(self.base, self.nbytes, self), device=self.device)

    def _map_chunk(self, c: int) -> bool:
        cu, lo = _libcuda(), c * self.chunk
        handle = ctypes.c_uint64()
        result = cu.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(self.chunk),
                                ctypes.byref(self._prop), ctypes.c_ulonglong(0))  # fmt: skip
        if result == CUDA_ERROR_OUT_OF_MEMORY:
            return False
        _check(result, "cuMemCreate")
        ptr = ctypes.c_uint64(self.base + lo)
        _check(cu.cuMemMap(ptr, ctypes.c_size_t(self.chunk), ctypes.c_size_t(0), handle,
                           ctypes.c_ulonglong(0)), "cuMemMap")  # fmt: skip
        _check(cu.cuMemSetAccess(ptr, ctypes.c_size_t(self.chunk), ctypes.byref(self._access),
                                 ctypes.c_size_t(1)), "cuMemSetAccess")  # fmt: skip
        self._handles[c] = handle.value
        return True

    def _unmap_chunk(self, c: int) -> None:
        cu = _libcuda()
        ptr = ctypes.c_uint64(self.base + c * self.chunk)
        _check(cu.cuMemUnmap(ptr, ctypes.c_size_t(self.chunk)), "cuMemUnmap")
        _check(cu.cuMemRelease(ctypes.c_uint64(self._handles[c])), "cuMemRelease")
        self._handles[c] = None

    def close(self) -> None:
        """Unmap everything and give the addresses back (the tensor must be unused)."""
        if getattr(self, "base", None) is None:
            return
        torch.cuda.synchronize(self.device)
        for c in self._mapped:
            self._unmap_chunk(c)
        self._mapped.clear()
        _libcuda().cuMemAddressFree(ctypes.c_uint64(self.base), ctypes.c_size_t(self._reserved))
        self.base = None

    def __del__(self) -> None:
        # At interpreter shutdown the driver may be gone first: it frees the memory anyway.
        with contextlib.suppress(Exception):
            self.close()


@functools.cache
def virtual_memory_works(device_index: int) -> bool:
    """Whether this device's driver maps memory on demand (one chunk reserved, mapped and
    freed). Without it the arena is one plain allocation: no room beyond the budget."""
    try:
        VirtualMemory(KV_CHUNK_BYTES, torch.device("cuda", device_index), KV_CHUNK_BYTES).close()
        return True
    except (OSError, AttributeError, RuntimeError) as e:
        log.warning("CUDA virtual memory unavailable (%s)", e)
        return False


def arena_memory(nbytes: int, device: torch.device, chunk_bytes: int = CHUNK_BYTES):
    """The backing for an arena on `device`: virtual memory on CUDA (plain memory, with one
    warning, if the driver refuses it), simulated chunks elsewhere. Nothing is mapped yet
    except what `VirtualMemory` needs to create its tensor: the arena maps what it uses."""
    if device.type != "cuda":
        return SimulatedMemory(nbytes, device, chunk_bytes)
    try:
        return VirtualMemory(nbytes, device, chunk_bytes)
    except (OSError, AttributeError, RuntimeError) as e:
        log.warning("CUDA virtual memory unavailable (%s): the arena's unused bytes cannot "
                    "be returned to the driver when the budget shrinks", e)  # fmt: skip
        return PlainMemory(nbytes, device)
