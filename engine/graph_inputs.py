"""The static input buffers of captured decode graphs, loaded by one host-to-device copy a step.

A graph reads its step's token ids, positions, KV slots, recurrent state rows, KV lengths and
page tables from fixed device buffers (cuda_graphs.py). Loading them one by one was six copies
from pageable memory, each staged by the driver, and six fills more whenever padding rows were
needed (a batch of 3 replays the graph of 4): a dozen host launches of every decode step. Here
the buffers are views into one device block laid out as one pinned host block: the host writes
the step's values (padding rows included) into the pinned block with numpy, and two copies move
what the step uses: the per-row values, and the page tables' used corner (rows 0..Bp-1, the
step's widest page count; whole rows would be megabytes at 32 rows of a 256k-token context).

Layout (bytes, in this order):
    int64 [4, N]: token ids, positions, KV slots, state rows
    int32 [N]: KV lengths
    int32 [N, Pm]: page tables

The pinned block is rewritten only by the next step's `load`, which first waits for the last
copy out of it (an event; always long done when the step before ended normally, since its
sampled tokens were read after the graph that followed the copy, but a step that failed midway
may not have waited). On a CPU device (tests) both blocks are plain memory and the copy is a
plain copy.

Shapes: N rows (the largest batch), Pm pages a sequence at most, B real rows, Bp padded rows.
"""

from __future__ import annotations

import torch

from freetoken_agent.engine.kv.pool import SCRATCH_PAGE
from freetoken_agent.engine.runner import StepInputs


class GraphInputs:
    def __init__(self, n: int, max_pages: int, page_size: int, device: torch.device) -> None:
        self.n, self.max_pages, self.page_size = n, max_pages, page_size
        self._i32_at = 4 * n * 8  # byte offsets of the int32 parts
        self._pages_at = self._i32_at + n * 4
        nbytes = self._pages_at + n * max_pages * 4
        self.device_block = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self.host_block = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
        dev, host = self._views(self.device_block), self._views(self.host_block)
        self.input_ids, self.positions, self.slot_mapping, self.state_slots = dev[0]  # [N] each
        self.kv_lens, self.page_table = dev[1], dev[2]  # [N], [N, Pm]
        (ids, pos, slots, states), lens, pages = host
        self._host_pages = pages  # [N, Pm] pinned, the source of the page tables' copy
        self._host = [a.numpy() for a in (ids, pos, slots, states, lens, pages)]
        # What a padding row holds: the scratch page (never a request's), KV length 1.
        self._host[4][:] = 1
        self._host[5][:] = SCRATCH_PAGE
        self._host[2][:] = SCRATCH_PAGE * page_size
        self.device_block.copy_(self.host_block)
        # Recorded after each copy out of the pinned block (CUDA): the next write waits on it.
        self._copied = torch.cuda.Event() if device.type == "cuda" else None

    def _views(self, block: torch.Tensor):
        n = self.n
        i64 = block[: self._i32_at].view(torch.int64).view(4, n)
        lens = block[self._i32_at : self._pages_at].view(torch.int32)
        pages = block[self._pages_at :].view(torch.int32).view(n, self.max_pages)
        return i64, lens, pages

    def load(self, inputs: StepInputs, bs: int) -> None:
        """Write a step of B <= `bs` rows and the padding rows up to `bs` into the static
        buffers: numpy into the pinned block, then two copies."""
        ids, pos, slots, states, lens, pages = self._host
        if self._copied is not None:
            self._copied.synchronize()  # the last copy out is done (an unrecorded event: at once)
        b = inputs.cu_q_lens.shape[0] - 1
        n_pages = inputs.page_table.shape[1]
        ids[:b], pos[:b], slots[:b] = inputs.input_ids, inputs.positions, inputs.slot_mapping
        states[:b], lens[:b] = inputs.state_slots, inputs.kv_lens
        pages[:b, :n_pages] = inputs.page_table
        if bs > b:  # padding rows: the scratch page, length 1
            ids[b:bs], pos[b:bs], states[b:bs] = 0, 0, 0
            slots[b:bs], lens[b:bs] = SCRATCH_PAGE * self.page_size, 1
            pages[b:bs, 0] = SCRATCH_PAGE
        head = self._pages_at  # the per-row values
        self.device_block[:head].copy_(self.host_block[:head], non_blocking=True)
        self.page_table[:bs, :n_pages].copy_(self._host_pages[:bs, :n_pages], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
