"""The CPU expert pool: every routed expert in host memory, the source of truth.

Banks are the FTW layout, `w13 [N, 2I, H]` and `w2 [N, H, I]` indexed by `lid`, so a slot fill is
one contiguous copy per bank and the CPU executor reads an expert as two contiguous blocks.

Pinning: host-to-device copies from pageable memory run at a fraction of PCIe speed (8 GB/s vs
55 GB/s measured on the H200 host), so the pool is page-locked when the OS allows: allocated
page-exclusive, filled, then registered in chunks aligned to expert rows, so a copy never
straddles two registrations (the mechanics, and why pages must be exclusive:
engine/host_memory.py). A failure to pin leaves the pool pageable with one warning: slower
fills, same results.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from freetoken_agent.engine.config import ModelSpec
from freetoken_agent.engine.host_memory import (
    moved_page_exclusive,
    page_exclusive,
    pin_rows_for,
    register_rows,
    release_registrations,
)

log = logging.getLogger("freetoken.experts")

# N = L * E expert rows (lid), H hidden, I expert width


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
            self.w13, self.w2 = (moved_page_exclusive(b) for b in (self.w13, self.w2))
            self._page_exclusive = True
        try:
            for bank in (self.w13, self.w2):
                register_rows(bank, self.pin_rows, self._registered)
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
            release_registrations(self._registered, (self.w13, self.w2))
        self._registered = []
        self.pinned = False

    def __del__(self) -> None:  # registrations must not outlive the memory they cover
        with contextlib.suppress(Exception):  # interpreter shutdown
            self.unpin()
