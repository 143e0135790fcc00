"""Fills that cross the link while the next decode step runs (policy `direct`, direct.py).

Under `direct` a miss needs no slot for the step that routes to it: the MoE kernels read it from
the pinned pool. A fill only helps later steps, so nothing needs to wait for it. `start` claims
slots (evicting least-recently-used victims), writes the victims' table entries on the compute
stream at once (the next step reads those experts from the pool), and queues the copies on the
copy stream with no wait on the compute side. `publish_ready`, at the end of a later step,
writes the entries of the batches whose copies are done. Until then the table sends those
experts to the pool, whose bytes are the same: results never depend on when a fill lands.

The host mirror counts a claimed expert as resident from `start` on (it is not asked again),
while the device table does not until it is published. Anything that reads the table as the
mirror has it (an eager fill, lending staging slots, a resize) calls `settle` first, which waits
for every batch and publishes it. On the CPU the copies are synchronous and a batch is
published by the next `publish_ready`, the same one-step delay, so tests see the same sequence.
"""

from __future__ import annotations

import torch


class InflightFills:
    def __init__(self, cache) -> None:
        self.cache = cache  # the ExpertCache whose slots and table these fills write
        self._batches: list[tuple[torch.cuda.Event | None, list[int]]] = []

    def __bool__(self) -> bool:
        return bool(self._batches)

    @property
    def lids(self) -> set[int]:
        """Lids filled whose table entries are not published yet."""
        return {lid for _, batch in self._batches for lid in batch}

    def start(self, lids: list[int], protect: set[int]) -> list[int]:
        """Fill the absent `lids` (as many as slots outside `protect` allow) without making
        compute wait; returns the lids claimed."""
        c = self.cache
        claimed = []
        for lid in [lid for lid in lids if c._slot_of[lid] < 0]:  # before any eviction
            slot = c._claim(lid, protect)
            if slot is None:
                break
            claimed.append((lid, slot))
        if not claimed:
            return []
        victims, c.table.unpublished = c.table.unpublished, []
        c.table.write_now(victims)  # compute stream: the next step reads them from the pool
        event = None
        if c.copy_stream is None:
            for lid, slot in claimed:
                c._copy_in(lid, slot)
        else:
            # After the victims' entries: no step queued from now on reads a victim's slot,
            # and the step that last did has finished (the host read its routing).
            c.copy_stream.wait_stream(torch.cuda.current_stream(c.device))
            with torch.cuda.stream(c.copy_stream):
                for lid, slot in claimed:
                    c._copy_in(lid, slot)
            event = torch.cuda.Event()
            event.record(c.copy_stream)
        filled = [lid for lid, _ in claimed]
        self._batches.append((event, filled))
        return filled

    def publish_ready(self) -> None:
        """Publish the batches whose copies are done, oldest first (one copy stream: they
        finish in order); on the CPU every batch started before this call."""
        done: list[int] = []
        while self._batches and (self._batches[0][0] is None or self._batches[0][0].query()):
            done += self._batches.pop(0)[1]
        self.cache.table.write_now(done)

    def settle(self) -> None:
        """Wait for every batch and publish it: the table then matches the host mirror."""
        if not self._batches:
            return
        for event, _ in self._batches:
            if event is not None:
                event.synchronize()
        self.publish_ready()  # every batch is done now
