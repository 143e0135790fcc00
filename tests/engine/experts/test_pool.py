"""The CPU expert pool: projections by lid, and pinning that falls back instead of failing."""

from __future__ import annotations

import gc
import logging
import random

import pytest
import torch
from tiny_models import tiny_config

from freetoken_agent.engine import host_memory
from freetoken_agent.engine.cuda_graphs import collection_paused
from freetoken_agent.engine.experts.pool import ExpertPool
from freetoken_agent.engine.host_memory import PAGE, pin_rows_for
from freetoken_agent.engine.models.registry import spec_from_config


def _spec():
    return spec_from_config(tiny_config("qwen3_moe").to_dict())


def test_projections_are_views_of_the_lid_rows():
    spec = _spec()
    pool = ExpertPool.empty(spec, torch.float32)
    i = spec.moe_intermediate_size
    gate = pool.projection(1, 3, "gate", spec.n_experts)
    gate.fill_(2.0)
    assert torch.equal(pool.w13[1 * spec.n_experts + 3, :i], torch.full_like(gate, 2.0))
    assert pool.projection(0, 0, "down", spec.n_experts).shape == (spec.hidden_size, i)
    assert pool.n_rows == spec.n_moe_layers * spec.n_experts


def test_pin_failure_leaves_the_pool_pageable_with_one_warning(monkeypatch, caplog):
    pool = ExpertPool.empty(_spec(), torch.float32)

    class FailingCudart:
        calls = 0

        def cudaHostRegister(self, ptr, size, flags):  # noqa: N802 (CUDA's name)
            FailingCudart.calls += 1
            return 0 if FailingCudart.calls == 1 else 2  # the second chunk fails

        def cudaHostUnregister(self, ptr):  # noqa: N802
            return 0

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: FailingCudart())
    monkeypatch.setattr(pool, "pin_rows", 1)  # one registration per row: several calls
    with caplog.at_level(logging.WARNING, logger="freetoken.experts"):
        assert pool.pin() is False
    assert not pool.pinned and pool._registered == []  # the first registration was undone
    warnings = [r for r in caplog.records if "keeping it pageable" in r.getMessage()]
    assert len(warnings) == 1


class _RecordingCudart:
    """Registrations as the driver sees them: whole pages, none shared (else error 712)."""

    def __init__(self) -> None:
        self.pages: set[int] = set()
        self.calls: list[tuple[int, int]] = []
        self.released: list[int] = []

    def cudaHostRegister(self, ptr, size, flags):  # noqa: N802 (CUDA's name)
        pages = set(range(ptr // PAGE, -(-(ptr + size) // PAGE)))
        self.calls.append((ptr, size))
        if pages & self.pages:
            return 712
        self.pages |= pages
        return 0

    def cudaHostUnregister(self, ptr):  # noqa: N802
        size = dict(self.calls)[ptr]
        self.pages -= set(range(ptr // PAGE, -(-(ptr + size) // PAGE)))
        self.released.append(ptr)
        return 0


def _small_tensors(rng: random.Random) -> list[torch.Tensor]:
    return [torch.empty(rng.randrange(1, 300)) for _ in range(rng.randrange(20, 60))]


def test_banks_own_their_pages_so_two_small_pools_both_pin(monkeypatch, rng_seed):
    """Tiny pools come from the heap: unaligned, they shared pages with each other and with
    ordinary tensors, and the second registration failed on the device (error 712)."""
    rng = random.Random(rng_seed)
    cudart = _RecordingCudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    pools, neighbours = [], []
    for _ in range(3):
        neighbours += _small_tensors(rng)
        pools.append(ExpertPool.empty(_spec(), torch.float32))
    for pool in pools:
        assert pool.pin() is True
        for bank in (pool.w13, pool.w2):
            assert bank.data_ptr() % PAGE == 0 and bank.is_contiguous()
            # torch's is_pinned (checked by the direct policy's kernels) asks the storage
            assert bank.untyped_storage().data_ptr() == bank.data_ptr()
    owned = cudart.pages
    for t in neighbours:  # no ordinary tensor lies on a registered page
        first, last = t.data_ptr() // PAGE, (t.data_ptr() + t.nbytes - 1) // PAGE
        assert not owned & set(range(first, last + 1))


def test_pool_of_foreign_tensors_moves_before_pinning(monkeypatch, rng_seed):
    g = torch.Generator().manual_seed(rng_seed)
    rows, h, i = 6, 64, 32  # rows of four and two pages
    w13, w2 = torch.randn(rows, 2 * i, h, generator=g), torch.randn(rows, h, i, generator=g)
    pool = ExpertPool(w13.clone(), w2.clone())
    cudart = _RecordingCudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(host_memory, "PIN_CHUNK_BYTES", 40000)  # three chunks a bank
    pool.pin_rows = pin_rows_for((pool.w13[0].nbytes, pool.w2[0].nbytes))
    assert pool.pin() is True and len(cudart.calls) == 6
    assert torch.equal(pool.w13, w13) and torch.equal(pool.w2, w2)  # same values, moved
    for ptr, _ in cudart.calls:
        assert ptr % PAGE == 0  # every chunk starts on a page of its own


def test_pin_rows_end_every_chunk_on_a_page(rng_seed):
    rng = random.Random(rng_seed)
    for _ in range(50):
        h, i, item = rng.randrange(1, 5000), rng.randrange(1, 3000), rng.choice((2, 4))
        row13, row2 = 2 * i * h * item, h * i * item
        rows = pin_rows_for((row13, row2))
        assert rows * row13 % PAGE == 0 and rows * row2 % PAGE == 0
        assert rows * row13 < host_memory.PIN_CHUNK_BYTES + PAGE * row13  # near the chunk size


def test_a_release_inside_a_graph_capture_waits_and_keeps_the_memory(monkeypatch):
    """A collection inside a capture ran an old pool's release, which the driver forbids
    there: the capture broke and the registration outlived its memory (device, error 712)."""
    cudart = _RecordingCudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(host_memory, "_deferred", [])
    old = ExpertPool.empty(_spec(), torch.float32)
    assert old.pin()
    ptrs, banks = list(old._registered), (old.w13, old.w2)
    monkeypatch.setattr(host_memory, "_capturing", lambda: True)
    del old  # finalized inside the "capture"
    assert cudart.released == []
    assert host_memory._deferred == [(ptrs, banks)]  # the banks stay alive with their pins
    monkeypatch.setattr(host_memory, "_capturing", lambda: False)
    new = ExpertPool.empty(_spec(), torch.float32)
    assert new.pin()  # releases what waited before registering
    assert cudart.released == ptrs and host_memory._deferred == []


def test_graph_capture_pauses_garbage_collection():
    assert gc.isenabled()
    with pytest.raises(ValueError), collection_paused():
        assert not gc.isenabled()
        raise ValueError  # a failed capture still restores collection
    assert gc.isenabled()


def test_huge_pages_are_asked_for_only_when_set(monkeypatch, rng_seed):
    """FREETOKEN_HUGE_PAGES=1 advises every page-exclusive mapping before it is touched."""
    advised = []
    monkeypatch.setattr(host_memory, "advise_huge", lambda m: advised.append(len(m)))
    shape = (random.Random(rng_seed).randint(1, 64), 1000)
    monkeypatch.delenv("FREETOKEN_HUGE_PAGES", raising=False)
    host_memory.page_exclusive(shape, torch.float32)
    assert advised == []
    monkeypatch.setenv("FREETOKEN_HUGE_PAGES", "1")
    t = host_memory.page_exclusive(shape, torch.float32)
    assert advised == [shape[0] * 1000 * 4] and t.shape == shape
