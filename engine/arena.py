"""The elastic device arena: one budget shared by KV pages and expert slots (DESIGN.md, idea 3).

`nbytes` of budget split by `boundary` (bytes): KV pages take [0, boundary), expert slots
[boundary, nbytes), counted as if they lay in one range, pages from the bottom and slots from
the top; the split's arithmetic below works in that range. Physically they live in two ranges
of device addresses, each reserved once at its largest size and backed by memory only where
in use (engine/device_memory.py): nothing is ever reallocated, so every pointer handed to
kernels and captured in CUDA graphs stays valid. Callers shrink the side that loses bytes
first (evict or migrate what lives there), then move the boundary, then grow the other side.

KV: one lane of addresses per layer and per K/V, 2L lanes of `lane_bytes` holding P_max pages
each, so one layer's pages are as dense as in a fixed pool: kernels see the same [P, S, Hkv, D]
layout either way, and a long context's attention touches few translation pages. (The first
layout kept every layer of a page together, one layer's pages 2*L*S*Hkv*D elements apart; on
the device the elastic engine's time to first token then ran above a fixed split's at long
contexts.) With E = lane_bytes / itemsize elements a lane:
    k [L, P_max, S, Hkv, D] strides (E, S*Hkv*D, Hkv*D, D, 1), offset 0
    v the same strides, offset L * E
Growing the pages maps the next bytes of every lane; shrinking unmaps them (whole chunks of
KV_CHUNK_BYTES: 2L partial chunks are the layout's slack).

Slots: slot s occupies [s * unit_slot, (s + 1) * unit_slot) of the slot range, unit_slot =
(2I*H + H*I) * itemsize: its w13 rows [2I, H] then its w2 rows [H, I]. With U = unit_slot /
itemsize elements:
    w13 [S_max, 2I, H] strides (U, H, 1), offset 0
    w2  [S_max, H, I]  strides (U, I, 1), offset 2I*H
S_max = nbytes // unit_slot. Slot ids are absolute (slot s is always at the same address); the
usable ones are first_slot .. S_max-1, the ones below are not backed.

kv_pages = boundary // unit_kv usable pages (page 0 is the scratch page), first_slot =
ceil(boundary / unit_slot): less than one unit of either is lost where they meet. An arena
without a slot unit (resident experts, no MoE offload) is a resizable KV region.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from freetoken_agent.engine.device_memory import CHUNK_BYTES, KV_CHUNK_BYTES, arena_memory

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
        pages: int | None = None,
    ) -> None:
        """`chunk_bytes`: the slots' map/release granularity; the KV lanes use at most
        KV_CHUNK_BYTES (2L lanes each round up to a chunk). `pages`: the pages in use at the
        start (`initial_pages`, backed now; default: every page below the boundary)."""
        if nbytes < 2 * kv.nbytes:
            raise ValueError(f"an arena of {nbytes} bytes holds fewer than 2 KV pages")
        self.device = torch.device(device)
        self.nbytes = nbytes
        self.kv_unit, self.slot_unit = kv, slot
        self.max_pages = nbytes // kv.nbytes
        self.max_slots = nbytes // slot.nbytes if slot is not None else 0
        # A lane: one layer's K (or V) for every page, whole chunks (lanes share no chunk).
        # A simulated device (the CPU) has no mapping granularity: its lanes map page by page,
        # or in runs of pages that keep a lane to 256 chunks (bookkeeping loops stay short).
        self.page_lane_bytes = kv.layer_elems * kv.dtype.itemsize  # one page of one lane
        if self.device.type == "cuda":
            kv_chunk = min(KV_CHUNK_BYTES, chunk_bytes)
        else:
            kv_chunk = self.page_lane_bytes * -(-self.max_pages // 256)
        self.lane_bytes = -(-self.max_pages * self.page_lane_bytes // kv_chunk) * kv_chunk
        self.kv_memory = arena_memory(2 * kv.n_layers * self.lane_bytes, self.device, kv_chunk)
        self.kv_buffer = self.kv_memory.view()  # [2L * lane_bytes] uint8
        self.k, self.v = self._kv_views()
        self.slot_memory = self.slot_buffer = None
        self.w13 = self.w2 = None
        if slot is not None:
            self.slot_memory = arena_memory(self.max_slots * slot.nbytes, self.device, chunk_bytes)
            self.slot_buffer = self.slot_memory.view()  # [S_max * unit_slot] uint8
            self.w13, self.w2 = self._slot_views()
            # Slot 0 is rarely in use (slots fill from the top), but w13's and w2's first
            # elements lie there: keep those chunks mapped, or kernels refuse the views.
            # (KV needs nothing: page 0 of every lane is always in use.)
            if not all(self.slot_memory.keep(o) for o in self._slot_view_offsets()):
                raise torch.cuda.OutOfMemoryError("no device memory for the arena's slot views")
        self.boundary = 0
        self.set_boundary(nbytes if boundary is None else boundary)
        self.initial_pages = self.kv_pages if pages is None else pages
        if not 2 <= self.initial_pages <= self.kv_pages:
            raise ValueError(
                f"{self.initial_pages} pages in use, {self.kv_pages} below the boundary"
            )
        if not self.map_for(self.initial_pages, self.first_slot):
            raise torch.cuda.OutOfMemoryError(f"no device memory for an arena of {nbytes} bytes")

    def _kv_views(self) -> tuple[torch.Tensor, torch.Tensor]:
        u = self.kv_unit
        flat = self.kv_buffer.view(u.dtype)
        lane = self.lane_bytes // u.dtype.itemsize
        shape = (u.n_layers, self.max_pages, u.page_size, u.n_kv_heads, u.head_dim)
        stride = (lane, u.layer_elems, u.n_kv_heads * u.head_dim, u.head_dim, 1)
        k = flat.as_strided(shape, stride, 0)  # [L, P_max, S, Hkv, D]
        v = flat.as_strided(shape, stride, u.n_layers * lane)  # [L, P_max, S, Hkv, D]
        return k, v

    def _slot_views(self) -> tuple[torch.Tensor, torch.Tensor]:
        u = self.slot_unit
        flat = self.slot_buffer.view(u.dtype)
        h, i, n = u.hidden, u.inter, self.max_slots
        w13 = flat.as_strided((n, 2 * i, h), (u.elems, h, 1), 0)  # [S_max, 2I, H]
        w2 = flat.as_strided((n, h, i), (u.elems, i, 1), 2 * i * h)  # [S_max, H, I]
        return w13, w2

    def scratch_banks(self, first: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots first .. first+n-1, while they hold no experts (lent to the prefill streamer),
        as two contiguous banks over their bytes: w13 [n, 2I, H], then w2 [n, H, I]. Through
        the strided slot views, a host-to-device copy is no DMA: torch copies into a contiguous
        temporary, then launches an elementwise kernel into the strided rows. Staging a
        streamed layer there cost a 32k-token prefill on the device ~12k kernels, each waiting
        on the copy stream behind compute for SMs and stalling the next layer's DMA: elastic's
        time to first token ran 20-30% above a fixed split's on every long turn."""
        u = self.slot_unit
        h, i = u.hidden, u.inter
        flat = self.slot_buffer.view(u.dtype)[first * u.elems : (first + n) * u.elems]
        return flat[: n * 2 * i * h].view(n, 2 * i, h), flat[n * 2 * i * h :].view(n, h, i)

    def _slot_view_offsets(self) -> tuple[int, int]:
        """Byte offsets of the first elements of w13 and w2 in the slot range."""
        u = self.slot_unit
        return 0, 2 * u.inter * u.hidden * u.dtype.itemsize

    # --- the split --------------------------------------------------------------------------
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
        slots = self.slot_memory.mapped_bytes if self.slot_memory is not None else 0
        return self.kv_memory.mapped_bytes + slots

    def _lanes(self, lo_page: int, hi_page: int):
        """[lo, hi) byte ranges of pages lo_page .. hi_page-1 in every lane."""
        pb, lane = self.page_lane_bytes, self.lane_bytes
        for j in range(2 * self.kv_unit.n_layers):
            yield j * lane + lo_page * pb, j * lane + hi_page * pb

    def _slot_span(self, first_slot: int) -> tuple[int, int]:
        return first_slot * self.slot_unit.nbytes, self.max_slots * self.slot_unit.nbytes

    def kv_backed(self, pages: int) -> bool:
        """Whether pages 0..pages-1 of every lane are backed by memory."""
        return all(self.kv_memory.is_mapped(a, b) for a, b in self._lanes(0, pages))

    def slots_backed(self, first_slot: int) -> bool:
        return self.slot_unit is None or self.slot_memory.is_mapped(*self._slot_span(first_slot))

    def map_for(self, pages: int, first_slot: int) -> bool:
        """Back pages 0..pages-1 and slots first_slot.. with memory. False when the device is
        out of memory: the caller keeps the pages and slots it had."""
        if not all(self.kv_memory.map(a, b) for a, b in self._lanes(0, pages)):
            return False
        return self.slot_unit is None or self.slot_memory.map(*self._slot_span(first_slot))

    def release_unused(self, pages: int, first_slot: int) -> int:
        """Give back the chunks wholly above page `pages` in every lane and below slot
        `first_slot`; returns the bytes released. Waits for the device first: work in flight
        (a moved expert's copy, a vacated page's copy) may still read the released range."""
        lane = self.lane_bytes
        work = [(self.kv_memory, a, (j + 1) * lane)  # each lane above its page `pages`
                for j, (a, _) in enumerate(self._lanes(pages, pages))]  # fmt: skip
        if self.slot_unit is not None:  # the slot range below first_slot
            work.append((self.slot_memory, 0, self._slot_span(first_slot)[0]))
        work = [(m, a, b) for m, a, b in work if m.releasable(a, b)]
        if not work:
            return 0
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return sum(m.unmap(a, b) for m, a, b in work)

    def check_integrity(self) -> None:
        assert 0 < self.boundary <= self.nbytes, "boundary outside the budget"
        assert self.kv_pages >= 2, "fewer than 2 KV pages"
        assert self.kv_bytes <= self.boundary, "KV pages cross the boundary"
        assert self.k.data_ptr() == self.kv_buffer.data_ptr(), "k view moved"
        assert self.k.untyped_storage().data_ptr() == self.kv_buffer.untyped_storage().data_ptr()
        if self.slot_unit is not None:
            assert self.first_slot * self.slot_unit.nbytes >= self.boundary or (
                self.first_slot == self.max_slots
            ), "a usable slot starts below the boundary"
            assert self.max_slots * self.slot_unit.nbytes <= self.nbytes, "slots past the end"
            assert self.w13.data_ptr() == self.slot_buffer.data_ptr(), "w13 view moved"
            assert self.slots_backed(self.first_slot), "a usable slot is not backed by memory"
            assert all(self.slot_memory.is_mapped(o, o + 1) for o in self._slot_view_offsets()), (
                "a slot view's first element is not backed (kernels check base pointers)"
            )
