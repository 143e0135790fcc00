"""Token embeddings: the table on the device, or in pinned host memory read by the device.

A step reads one row of the table per token ([T, H] of a [V, H] table), so the table's bytes
buy nothing on the device but a gather. With the experts offloaded every device byte is an
expert slot: Qwen3-30B-A3B's untied table (151936 x 2048 bf16, 622 MB) is 66 slots, 11% more
at the 8 GiB laptop tier. So, as llama.cpp keeps `token_embd` in host memory, the table of an
offloaded model stays on the host (`on_host`), pinned, and the device reads the step's rows
itself through the mapping of pinned memory (kernels/row_copy.py with a host source): no host
work per step, so the gather stays inside captured decode graphs. A decode token reads 4 KB
over the link; an 8192-token prefill chunk 33 MB, about a millisecond against the chunk's
hundreds streaming experts. A tied table is also the LM head, read whole every step: it stays
on the device.

Shapes: V vocabulary, H hidden, T tokens.
"""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.nn.functional as F
from torch import nn

from freetoken_agent.engine.host_memory import (
    moved_page_exclusive,
    pin_rows_for,
    register_rows,
    release_registrations,
)
from freetoken_agent.kernels.row_copy import row_copy

log = logging.getLogger("freetoken.load")


class TokenEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, on_host: bool = False) -> None:
        """`on_host`: the table is allocated in host memory (pin it with `pin`)."""
        super().__init__()
        device = torch.device("cpu") if on_host else None  # None: the default device
        table = torch.empty(vocab_size, hidden_size, device=device)
        self.weight = nn.Parameter(table, requires_grad=False)  # [V, H]
        self.on_host = on_host
        self._registered: list[int] = []  # page-locked ranges of the host table

    @property
    def device_nbytes(self) -> int:
        """Bytes the table takes in device memory (0 on the host)."""
        return 0 if self.on_host else self.weight.nbytes

    @property
    def host_nbytes(self) -> int:
        """Bytes the table takes in host memory (0 on the device)."""
        return self.weight.nbytes - self.device_nbytes

    def pin(self) -> bool:
        """Page-lock the host table (CUDA), so the device can read it. Returns whether it
        worked; the caller moves the table to the device otherwise. Registered as the expert
        pool is (engine/host_memory.py): `pin_memory()` would round a 622 MB table up to 1 GB of
        page-locked memory (torch's pinned allocator rounds to powers of two)."""
        assert self.on_host, "the table is on the device"
        if self._registered:
            return True
        table = moved_page_exclusive(self.weight.data)
        try:
            register_rows(table, pin_rows_for((table[0].nbytes,)), self._registered)
        except Exception as e:  # noqa: BLE001 - any pinning failure: the table moves
            self._release(table)
            log.warning("could not pin the %.2f GB embedding table (%s); it goes on the device",
                        table.nbytes / 1e9, e)  # fmt: skip
            return False
        self.weight.data = table
        return True

    def to_device(self, device: torch.device) -> None:
        """Move a host table to `device` (the budget holds it, or it could not be pinned)."""
        host = self.weight.data
        self.weight.data = host.to(device)
        self._release(host)
        self.on_host = False

    def _release(self, table: torch.Tensor) -> None:
        """Release the registrations over `table` (kept alive until they are released)."""
        if self._registered:
            release_registrations(self._registered, (table,))
        self._registered = []

    def __del__(self) -> None:  # registrations must not outlive the memory they cover
        with contextlib.suppress(Exception):  # interpreter shutdown
            self._release(self.weight.data)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> [T, H] on input_ids' device."""
        table = self.weight
        if table.device == input_ids.device:
            return F.embedding(input_ids, table)
        # The device reads the rows from the pinned host table (graph-safe: no host sync).
        n = input_ids.numel()
        out = torch.empty(n, table.shape[1], dtype=table.dtype, device=input_ids.device)
        rows = torch.arange(n, device=input_ids.device)
        row_copy(out, table, rows, input_ids.reshape(-1))
        return out
