"""The elastic device arena: one buffer shared by KV pages and expert slots (DESIGN.md, idea 3).

One `torch.uint8` buffer of `nbytes` on the device, allocated once. KV pages grow from the low
end, expert slots from the high end, and `boundary` (bytes) splits them: KV owns [0, boundary),
experts own [boundary, nbytes). Moving the boundary never reallocates, so every pointer handed
to kernels and captured in CUDA graphs stays valid; callers shrink the pool that loses bytes
first (evict or migrate what lives there), then move the boundary, then grow the other pool.

Layout (bytes):

    0        unit_kv  2*unit_kv          boundary                      S_max*unit_slot  nbytes
    | page 0 | page 1 | ... | page P-1 |  gap  | slot first_slot | ... | slot S_max-1 | tail |

- Page p occupies [p * unit_kv, (p + 1) * unit_kv), unit_kv = 2 * L * S * Hkv * D * itemsize:
  K of every attention layer, then V of every attention layer, each layer [S, Hkv, D] dense.
  Views over the whole buffer (P_max = nbytes // unit_kv pages), in elements of the KV dtype:
      k [L, P_max, S, Hkv, D] strides (S*Hkv*D, 2*L*S*Hkv*D, Hkv*D, D, 1), offset 0
      v the same strides, offset L*S*Hkv*D
  so `k[l]` is [P_max, S, Hkv, D] with stride(0) = 2*L*S*Hkv*D and its last three dims dense
  (what the paged attention kernels read), and a page is one contiguous run of bytes (one copy
  moves it, every layer, K and V).
- Slot s occupies [s * unit_slot, (s + 1) * unit_slot), unit_slot = (2I*H + H*I) * itemsize:
  its w13 rows [2I, H] then its w2 rows [H, I]. With U = unit_slot / itemsize elements:
      w13 [S_max, 2I, H] strides (U, H, 1), offset 0
      w2  [S_max, H, I]  strides (U, I, 1), offset 2I*H
  S_max = nbytes // unit_slot. Slot ids are absolute: slot s is always at the same address.
- kv_pages = boundary // unit_kv usable pages (page 0 is the scratch page), first_slot =
  ceil(boundary / unit_slot), usable slots first_slot .. S_max-1. The bytes between the last
  page and the first slot (less than one unit of either) and the tail above the last slot are
  unused. Only valid ids are ever touched: the views span the whole buffer so they never change.

An arena without a slot unit (resident experts, no MoE offload) is a resizable KV region.

Backing (engine/device_memory.py): on CUDA the buffer is a reserved range of virtual addresses
whose chunks are mapped only where pages or slots are in use; `release_unused` gives the gap
between the last page in use and the first slot (and the unused tail) back to the driver, so
another program can have it, and `map_for` backs a range again before it is used. On the CPU
the same bookkeeping runs over one tensor whose released chunks are scribbled.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from freetoken_agent.engine.device_memory import CHUNK_BYTES, arena_memory

# L attention layers, P pages, S page size (tokens), Hkv kv heads, D head_dim,
# H hidden, I expert width


@dataclass(slots=True, frozen=True)
class KVUnit:
    """One KV page: K and V of `page_size` tokens for every attention layer."""

    n_layers: int
    page_size: int
    n_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def layer_elems(self) -> int:
        return self.page_size * self.n_kv_heads * self.head_dim

    @property
    def nbytes(self) -> int:
        return 2 * self.n_layers * self.layer_elems * self.dtype.itemsize


@dataclass(slots=True, frozen=True)
class SlotUnit:
    """One expert slot: w13 [2I, H] then w2 [H, I]."""

    hidden: int
    inter: int
    dtype: torch.dtype

    @property
    def elems(self) -> int:
        return 3 * self.inter * self.hidden

    @property
    def nbytes(self) -> int:
        return self.elems * self.dtype.itemsize


class ElasticArena:
    def __init__(
        self,
        nbytes: int,
        device: torch.device | str,
        kv: KVUnit,
        slot: SlotUnit | None = None,
        boundary: int | None = None,
        chunk_bytes: int = CHUNK_BYTES,
    ) -> None:
        if nbytes < 2 * kv.nbytes:
            raise ValueError(f"an arena of {nbytes} bytes holds fewer than 2 KV pages")
        self.device = torch.device(device)
        self.kv_unit, self.slot_unit = kv, slot
        self.memory = arena_memory(nbytes, self.device, chunk_bytes)
        self.buffer = self.memory.view()  # [nbytes] uint8
        self.max_pages = nbytes // kv.nbytes
        self.k, self.v = self._kv_views()
        self.max_slots = nbytes // slot.nbytes if slot is not None else 0
        self.w13, self.w2 = self._slot_views() if slot is not None else (None, None)
        self.boundary = 0
        self.set_boundary(nbytes if boundary is None else boundary)
        if not self.map_for(self.kv_pages, self.first_slot):
            raise torch.cuda.OutOfMemoryError(f"no device memory for an arena of {nbytes} bytes")

    def _typed(self, dtype: torch.dtype) -> torch.Tensor:
        """The buffer in elements of `dtype` (a tail shorter than one element dropped)."""
        n = self.nbytes - self.nbytes % dtype.itemsize
        return self.buffer[:n].view(dtype)

    def _kv_views(self) -> tuple[torch.Tensor, torch.Tensor]:
        u = self.kv_unit
        flat = self._typed(u.dtype)
        shape = (u.n_layers, self.max_pages, u.page_size, u.n_kv_heads, u.head_dim)
        layer = u.layer_elems
        stride = (layer, 2 * u.n_layers * layer, u.n_kv_heads * u.head_dim, u.head_dim, 1)
        k = flat.as_strided(shape, stride, 0)  # [L, P_max, S, Hkv, D]
        v = flat.as_strided(shape, stride, u.n_layers * layer)  # [L, P_max, S, Hkv, D]
        return k, v

    def _slot_views(self) -> tuple[torch.Tensor, torch.Tensor]:
        u = self.slot_unit
        flat = self._typed(u.dtype)
        h, i, n = u.hidden, u.inter, self.max_slots
        w13 = flat.as_strided((n, 2 * i, h), (u.elems, h, 1), 0)  # [S_max, 2I, H]
        w2 = flat.as_strided((n, h, i), (u.elems, i, 1), 2 * i * h)  # [S_max, H, I]
        return w13, w2

    # --- the split --------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    @property
    def kv_pages(self) -> int:
        return min(self.boundary // self.kv_unit.nbytes, self.max_pages)

    @property
    def first_slot(self) -> int:
        if self.slot_unit is None:
            return 0
        return min(-(-self.boundary // self.slot_unit.nbytes), self.max_slots)

    @property
    def n_slots(self) -> int:
        return self.max_slots - self.first_slot

    @property
    def kv_bytes(self) -> int:
        return self.kv_pages * self.kv_unit.nbytes

    @property
    def slot_bytes(self) -> int:
        return self.n_slots * self.slot_unit.nbytes if self.slot_unit is not None else 0

    def set_boundary(self, boundary: int) -> None:
        """Move the split. Validates only: the caller has already emptied what the losing side
        gives up (KV pages >= the new kv_pages free, slots below the new first_slot vacated)."""
        if not 0 < boundary <= self.nbytes:
            raise ValueError(f"arena boundary {boundary} outside (0, {self.nbytes}]")
        if boundary // self.kv_unit.nbytes < 2:
            raise ValueError(f"arena boundary {boundary} leaves fewer than 2 KV pages")
        self.boundary = boundary

    def boundary_for(self, *, kv_pages: int | None = None, n_slots: int | None = None) -> int:
        """The boundary giving exactly `kv_pages` pages (the most slots beside them), or the
        largest boundary keeping `n_slots` slots (the most pages beside them)."""
        if (kv_pages is None) == (n_slots is None):
            raise ValueError("boundary_for takes exactly one of kv_pages, n_slots")
        if kv_pages is not None:
            if not 2 <= kv_pages <= self.max_pages:
                raise ValueError(f"kv_pages {kv_pages} outside [2, {self.max_pages}]")
            return kv_pages * self.kv_unit.nbytes
        if self.slot_unit is None or not 0 <= n_slots <= self.max_slots:
            raise ValueError(f"n_slots {n_slots} outside [0, {self.max_slots}]")
        if n_slots == 0:
            return self.nbytes
        return (self.max_slots - n_slots) * self.slot_unit.nbytes

    # --- backing memory --------------------------------------------------------------------
    @property
    def mapped_bytes(self) -> int:
        """Bytes of device memory the arena holds now (the whole arena without release)."""
        return self.memory.mapped_bytes

    def _slot_span(self, first_slot: int) -> tuple[int, int]:
        if self.slot_unit is None:
            return self.nbytes, self.nbytes
        return first_slot * self.slot_unit.nbytes, self.max_slots * self.slot_unit.nbytes

    def map_for(self, pages: int, first_slot: int) -> bool:
        """Back pages 0..pages-1 and slots first_slot.. with memory. False when the device is
        out of memory: the caller keeps the pages and slots it had."""
        lo, hi = self._slot_span(first_slot)
        return self.memory.map(0, pages * self.kv_unit.nbytes) and self.memory.map(lo, hi)

    def release_unused(self, pages: int, first_slot: int) -> int:
        """Give back the chunks wholly between page `pages` and slot `first_slot`, and above
        the last slot; returns the bytes released. Waits for the device first: work in flight
        (a moved expert's copy, a vacated page's copy) may still read the released range."""
        kv_top = pages * self.kv_unit.nbytes
        lo, hi = self._slot_span(first_slot)
        spans = ((kv_top, lo), (hi, self.nbytes))
        if not any(self.memory.releasable(a, b) for a, b in spans):
            return 0
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return self.memory.unmap(kv_top, lo) + self.memory.unmap(hi, self.nbytes)

    def check_integrity(self) -> None:
        assert 0 < self.boundary <= self.nbytes, "boundary outside the buffer"
        assert self.kv_pages >= 2, "fewer than 2 KV pages"
        assert self.kv_bytes <= self.boundary, "KV pages cross the boundary"
        base = self.buffer.data_ptr()
        assert self.k.data_ptr() == base, "k view moved"
        assert self.k.untyped_storage().data_ptr() == self.buffer.untyped_storage().data_ptr()
        if self.slot_unit is not None:
            assert self.first_slot * self.slot_unit.nbytes >= self.boundary or (
                self.first_slot == self.max_slots
            ), "a usable slot starts below the boundary"
            assert self.max_slots * self.slot_unit.nbytes <= self.nbytes, "slots past the end"
            assert self.w13.data_ptr() == base, "w13 view moved"
            lo, hi = self._slot_span(self.first_slot)
            assert self.memory.is_mapped(lo, hi), "a usable slot is not backed by memory"
