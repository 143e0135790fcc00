"""Full-layer expert streaming for long prefill chunks, double-buffered.

A prefill chunk of a few thousand tokens routes to nearly every expert of every layer, so
instead of filling slots expert by expert, each layer's whole expert set is copied into a
staging buffer and the layer computes from it. With two buffers, layer l+1 copies (on a
dedicated copy stream) while layer l computes; a buffer is overwritten only after the compute
that read it has finished (an event per buffer). Experts already resident in cache slots are
copied device-to-device instead of over PCIe. `double_buffer=False` keeps one buffer (copy and
compute then alternate) for the ablation.

The staging layout is the pool's, restricted to one layer ([E, 2I, H] and [E, H, I]), so the
layer computes exactly what the resident bank computes from its slice of the banks.

Where the cache has slots to spare (`lend=True`), the buffers are not memory of their own: the
last B * E slots of the cache are lent for the chunk (the cache's B * E coldest experts evicted,
the lent slots' experts moved into their slots) and returned when the chunk's last layer is
queued. Staging is needed only while a long chunk streams, and
reserving 2 * E experts for it permanently would cost a laptop budget most of its slots (2.4 GB
of an 8.59 GB budget at Qwen3-30B-A3B shapes).
"""

from __future__ import annotations

import torch

from freetoken_agent.engine.device_index import on_device
from freetoken_agent.engine.experts.cache import ExpertCache
from freetoken_agent.engine.experts.pool import ExpertPool
from freetoken_agent.kernels.row_copy import row_copy

# E experts per layer, H hidden, I expert width, B staging buffers (1 or 2)

# (token, expert) pairs per fused-MoE launch of a streamed layer. A streamed layer waits on the
# link (a 12-layer Qwen3-30B slice streams 14.5 GB per chunk), so the kernel's chunking costs
# nothing, while its buffers are memory taken from the slots: on the H200, an 8192-token
# chunk's peak allocation fell from 0.81 to 0.39 GB going from 65536 to 16384 pairs, and the
# prefill took 278 and 279 ms (bench/results/workspace_12l_s12_chunks.json). All-resident
# prefill is compute-bound and keeps the kernel's default: there 16384 cost 17% at 8192 tokens.
STREAMED_MOE_PAIRS = 16384


class LayerStreamer:
    def __init__(
        self,
        pool: ExpertPool,
        cache: ExpertCache,
        n_experts: int,
        n_layers: int,
        device: torch.device,
        double_buffer: bool = True,
        lend: bool = False,
    ) -> None:
        self.pool, self.cache = pool, cache
        self.lend = lend
        self.n_experts, self.n_layers = n_experts, n_layers
        self.device = device
        self.n_buffers = 2 if double_buffer else 1
        shape13, shape2 = pool.w13.shape[1:], pool.w2.shape[1:]
        b, e, dtype = self.n_buffers, n_experts, pool.w13.dtype
        self._shapes = (shape13, shape2)
        if lend:  # views into the cache's slots while a chunk streams; none in between
            self.w13 = self.w2 = None
        else:
            self.w13 = torch.empty((b, e, *shape13), dtype=dtype, device=device)  # [B, E, 2I, H]
            self.w2 = torch.empty((b, e, *shape2), dtype=dtype, device=device)  # [B, E, H, I]
        self.holds = [-1] * b  # which layer each buffer holds
        cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if cuda else None
        self.copied = [torch.cuda.Event() if cuda else None for _ in range(b)]
        self.consumed = [torch.cuda.Event() if cuda else None for _ in range(b)]
        self.bytes_h2d = 0
        self.bytes_d2d = 0
        self.layers_streamed = 0

    @property
    def nbytes(self) -> int:
        """Device bytes of its own (none when it borrows cache slots)."""
        return 0 if self.lend else self.w13.nbytes + self.w2.nbytes

    @property
    def borrowing(self) -> bool:
        return self.lend and self.w13 is not None

    def release(self) -> None:
        """Return borrowed slots to the cache (the chunk's compute is queued, and whoever
        fills those slots next orders its copies after queued compute)."""
        if self.borrowing:
            self.w13 = self.w2 = None
            self.holds = [-1] * self.n_buffers
            self.cache.take_back()

    def weights(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's full expert set ([E, 2I, H], [E, H, I]), ready for the compute stream;
        with two buffers, the next layer's copy is queued before returning."""
        if self.lend and self.w13 is None:
            b, e = self.n_buffers, self.n_experts
            w13, w2 = self.cache.lend(b * e)
            if self.copy_stream is not None:  # the lend's moves read these slots first
                self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            self.w13 = w13.view(b, e, *self._shapes[0])  # [B, E, 2I, H]
            self.w2 = w2.view(b, e, *self._shapes[1])  # [B, E, H, I]
            self.holds = [-1] * b
        buf = layer % self.n_buffers
        if self.holds[buf] != layer:
            self._issue(layer)
        if self.n_buffers > 1 and layer + 1 < self.n_layers:
            nxt = (layer + 1) % self.n_buffers
            if self.holds[nxt] != layer + 1:
                self._issue(layer + 1)
        if self.copy_stream is not None:
            torch.cuda.current_stream(self.device).wait_event(self.copied[buf])
        return self.w13[buf], self.w2[buf]

    def done(self, layer: int) -> None:
        """The layer's compute is queued: its buffer may be overwritten once that finishes."""
        buf = layer % self.n_buffers
        if self.copy_stream is not None:
            self.consumed[buf].record(torch.cuda.current_stream(self.device))
        if layer == self.n_layers - 1:
            self.release()

    def _issue(self, layer: int) -> None:
        buf = layer % self.n_buffers
        if self.copy_stream is None:
            self._copy_layer(layer, buf)
        else:
            self.copy_stream.wait_event(self.consumed[buf])
            with torch.cuda.stream(self.copy_stream):
                self._copy_layer(layer, buf)
                self.copied[buf].record(self.copy_stream)
        self.holds[buf] = layer
        self.layers_streamed += 1

    def _copy_layer(self, layer: int, buf: int) -> None:
        """Resident experts from their slot (device to device); the others from the pool in as
        few host copies as the pool's registrations allow."""
        base = layer * self.n_experts
        slot_of = self.cache.host_slot_of
        slots = slot_of[base : base + self.n_experts]
        resident = [(e, slot) for e, slot in enumerate(slots) if slot >= 0]
        if resident:  # one launch a bank (a copy each had cost the host ~90 a layer)
            dst_rows = on_device([e for e, _ in resident], torch.long, self.device)
            src_rows = on_device([slot for _, slot in resident], torch.long, self.device)
            row_copy(self.w13[buf], self.cache.w13, dst_rows, src_rows)
            row_copy(self.w2[buf], self.cache.w2, dst_rows, src_rows)
            self.bytes_d2d += len(resident) * self.pool.expert_bytes
        absent = [slot < 0 for slot in slots]
        for lo, hi in host_runs(absent, base, self.pool.pin_rows):
            rows = slice(base + lo, base + hi)
            self.w13[buf, lo:hi].copy_(self.pool.w13[rows], non_blocking=self.pool.pinned)
            self.w2[buf, lo:hi].copy_(self.pool.w2[rows], non_blocking=self.pool.pinned)
            self.bytes_h2d += (hi - lo) * self.pool.expert_bytes


def host_runs(absent: list[bool], base: int, pin_rows: int) -> list[tuple[int, int]]:
    """Maximal runs [lo, hi) of consecutive absent experts of a layer whose first lid is `base`,
    cut where a page-locked registration of `pin_rows` pool rows ends: one host copy must stay
    inside one registration (a copy spanning two fails with "invalid argument")."""
    runs, e, n = [], 0, len(absent)
    while e < n:
        if not absent[e]:
            e += 1
            continue
        boundary = ((base + e) // pin_rows + 1) * pin_rows - base
        hi = e + 1
        while hi < n and absent[hi] and hi < boundary:
            hi += 1
        runs.append((e, hi))
        e = hi
    return runs
