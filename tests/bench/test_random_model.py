"""Random-weight engines for benchmarks: an engine built over the host pool of an earlier one
(the benchmark draws and pins its experts once) is the same model as one drawn afresh."""

from __future__ import annotations

import random

import pytest

from freetoken_agent import SamplingParams
from freetoken_agent.bench.elastic_engines import TINY_QWEN3_MOE
from freetoken_agent.bench.random_model import random_engine


def test_engine_over_a_shared_pool_is_the_same_model(rng_seed):
    rng = random.Random(rng_seed)
    opts = dict(device="cpu", std=0.1, seed=rng_seed % 1000, policy="transfer", expert_slots=12)
    first = random_engine(TINY_QWEN3_MOE, **opts)
    pool = first.loaded.bank.pool
    shared = random_engine(TINY_QWEN3_MOE, pool=pool, **{**opts, "expert_slots": 20})
    fresh = random_engine(TINY_QWEN3_MOE, **opts)
    assert shared.loaded.bank.pool is pool and fresh.loaded.bank.pool is not pool
    prompt = [rng.randrange(3, 500) for _ in range(rng.randint(20, 60))]
    sp = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    assert shared.generate(prompt, sp).token_ids == fresh.generate(prompt, sp).token_ids
    with pytest.raises(ValueError, match="a pool of"):
        random_engine({**TINY_QWEN3_MOE, "num_experts": 8}, pool=pool, **opts)
