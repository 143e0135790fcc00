"""Elastic engines for tests: a budget that holds the fixed bytes and a little more."""

from __future__ import annotations

import torch

from freetoken_agent import Engine
from freetoken_agent.engine.experts.placement import workspace_bytes
from freetoken_agent.engine.kv.pool import KVPool
from freetoken_agent.engine.kv.recurrence import recurrent_device_bytes
from freetoken_agent.engine.loading import dense_nbytes


def elastic_engine(path, checkpoints: str) -> Engine:
    """An elastic engine whose budget holds its fixed bytes (a hybrid's recurrent memory too),
    512 tokens of KV and a few slots beyond the fewest; prefill chunks of 64 tokens."""
    probe = Engine.load(path, device="cpu", progress=False, policy="resident")
    spec, config = probe.spec, probe.config
    page = KVPool.page_bytes(len(spec.attention_layers), config.page_size, spec.n_kv_heads,
                             spec.head_dim, spec.dtype)  # fmt: skip
    budget = (
        dense_nbytes(probe.loaded.model)
        + workspace_bytes(spec, config, offloaded=True)
        + recurrent_device_bytes(spec, config, torch.device("cpu"), spec.dtype, 0)
        + 33 * page
        + (3 * spec.n_experts + 8) * spec.expert_bytes
    )
    engine = Engine.load(path, device="cpu", progress=False, policy="transfer", gpu_budget=budget,
                         kv_tokens=512, max_batched_tokens=64, checkpoints=checkpoints)  # fmt: skip
    assert engine.memory is not None
    return engine
