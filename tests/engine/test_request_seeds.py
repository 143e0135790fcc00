"""A request's seed uses all 64 bits: torch's CPU generator keeps the low 32 of what it is
given, so seeds that differ only above bit 31 drew the same tokens (a client's
base + (run << 32) got one sample for every run; n choices seeded seed + i crossed into
seed 0's). `runner.generator_seed` keeps seeds below 2**32 as they were and mixes the others
down. Seeds and prompts are drawn fresh."""

from __future__ import annotations

import random

import pytest
from tiny_models import make_tiny

from freetoken_agent import Engine, SamplingParams
from freetoken_agent.engine.runner import generator_seed


def test_generator_seed_keeps_low_seeds_and_separates_high_ones(rng_seed):
    rng = random.Random(rng_seed)
    for _ in range(200):
        low = rng.randrange(2**32)
        assert generator_seed(low) == low  # the draws of every seed used so far unchanged
        family = {generator_seed(low + k * 2**32) for k in range(64)}
        assert len(family) == 64, low  # base + (run << 32): a stream a run
        assert generator_seed(low - 2**64) == generator_seed(low)  # the same 64 bits
        assert 0 <= generator_seed(rng.randrange(-(2**63), 2**64)) < 2**32


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    folder = tmp_path_factory.mktemp("m")
    make_tiny("qwen3_moe", folder, random.randrange(2**31))
    return Engine.load(folder, device="cpu", progress=False, kv_tokens=2048)


def test_seeds_that_differ_above_bit_31_sample_apart(engine, rng_seed):
    rng = random.Random(rng_seed)
    prompt = [rng.randrange(engine.spec.vocab_size) for _ in range(rng.randint(2, 12))]
    seed = rng.randrange(2**32)

    def sampled(s: int) -> list[int]:
        sp = SamplingParams(max_tokens=24, temperature=1.5, seed=s, ignore_eos=True)
        return engine.generate(prompt, sp).token_ids

    base = sampled(seed)
    assert sampled(seed) == base  # a seed still repeats
    assert sampled(seed + 2**32) != base
    assert sampled(seed + rng.randint(2, 2**31) * 2**32) != base
    assert sampled(-1) == sampled(2**64 - 1)  # the same 64 bits
