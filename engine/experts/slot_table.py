"""The expert cache's device table: `slot_of [N]`, lid -> slot (-1 when absent), which the fused
MoE kernels read, and the writes that keep it equal to the host mirror.

The host mirror (ExpertCache's `_slot_of`) is the truth; entries are written from it. An
eviction is not written at once: it waits (`unpublished`) for the fills that replace it, and
`publish` writes both, on the copy stream behind the fills' copies, so compute sees the new
experts and the lost ones at the same point of its stream. It lives apart from cache.py
because it is a matter of streams and staging (when compute may see an entry), not of which
expert holds which slot.
"""

from __future__ import annotations

import torch

from freetoken_agent.engine.device_index import on_device

# N = L * E lids


class SlotTable:
    def __init__(
        self, mirror: list[int], device: torch.device, copy_stream: torch.cuda.Stream | None
    ) -> None:
        """`mirror`: the cache's host mirror ([N] lid -> slot), read for every entry written;
        `copy_stream`: the cache's (None on a CPU device)."""
        self.mirror = mirror
        self.device = device
        self.copy_stream = copy_stream
        self.slot_of = torch.full((len(mirror),), -1, dtype=torch.int32, device=device)  # [N]
        # Table entries of evicted lids not yet on the device: `publish` writes them with the
        # fills that replace them, on the copy stream, so compute sees both at once.
        self.unpublished: list[int] = []

    def publish(self, lids: list[int]) -> None:
        """Write filled slots, and the evictions they replaced, into the device table; compute
        queued from now on waits for the copies. On CUDA the entries travel from pinned memory
        on the copy stream behind the fills, so the host does not wait for the copies (torch's
        pinned allocator keeps each buffer until its copy is done)."""
        evicted, self.unpublished = self.unpublished, []
        if not lids and not evicted:
            return
        keys = evicted + lids  # an evicted lid filled again gets its new slot: keys in order
        if self.copy_stream is None:
            self.write_now(keys)
            return
        with torch.cuda.stream(self.copy_stream):
            self.write_now(keys)
        torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)

    def write_now(self, lids: list[int]) -> None:
        """Table entries written on the current stream (the compute stream for direct's
        fills, the copy stream inside `publish`), in one indexed write (a lend evicts up to
        two layers' experts: hundreds of single-element writes, each a copy and a launch, had
        been milliseconds of every streamed chunk). index_put_ with duplicate keys
        has no defined winner; the host mirror is the truth, so every duplicate carries the
        same (final) value."""
        if not lids:
            return
        # Keys and slots in one int32 buffer: one pinned staging tensor and one copy, not two
        # (each `aten::copy_` cost ~14 us of host time with its dispatch in the H200 host's
        # 48-layer profile, and a publish ends every stop). torch indexes with int32 since 2.0.
        n, slot_of = len(lids), self.mirror
        both = on_device(lids + [slot_of[lid] for lid in lids], torch.int32, self.device)
        self.slot_of.index_put_((both[:n],), both[n:])

    def clear(self) -> None:
        """Every entry absent, nothing left to publish (the cache emptied)."""
        self.unpublished.clear()
        self.slot_of.fill_(-1)

    def check(self, inflight: set[int]) -> None:
        """The table equals the mirror but for `inflight`: lids claimed whose copies are in
        flight, which the device still sends to the pool."""
        host = torch.tensor(self.mirror, dtype=torch.int32)
        pending = sorted(inflight)
        if pending:  # claimed, copies in flight: the device sends them to the pool
            host[torch.tensor(pending, dtype=torch.long)] = -1
        assert torch.equal(self.slot_of.cpu(), host), "device lid->slot table out of sync"
