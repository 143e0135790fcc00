"""The CPU expert pool: projections by lid, and pinning that falls back instead of failing."""

from __future__ import annotations

import logging

import torch
from tiny_models import tiny_config

from freetoken_agent.engine.experts.pool import ExpertPool
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
