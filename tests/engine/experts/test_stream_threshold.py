"""The streaming threshold derived from bandwidths (engine/experts/stream_threshold.py)."""

from __future__ import annotations

import random

import pytest
from tiny_models import make_tiny

from freetoken_agent import Engine
from freetoken_agent.engine.experts.policy import Bandwidths
from freetoken_agent.engine.experts.stream_threshold import (
    STEP,
    binomial_quantiles,
    layer_seconds,
    placed_seconds,
    stream_threshold,
)


def test_binomial_quantiles_follow_the_distribution(rng_seed):
    rng = random.Random(rng_seed)
    for _ in range(20):
        n, p, count = rng.randint(0, 3000), rng.uniform(0.001, 0.5), rng.randint(8, 512)
        q = binomial_quantiles(n, p, count)
        assert q == sorted(q, reverse=True) and all(0 <= c <= n for c in q)
        mean, sd = n * p, (n * p * (1 - p)) ** 0.5
        assert abs(sum(q) / count - mean) <= 0.6 + 0.1 * sd, (n, p, count)  # quantile rounding
        assert q[0] <= mean + 4 * sd + 1 and q[-1] >= mean - 4 * sd - 1
    n = rng.randint(0, 100)  # top-k of every expert, or of none
    assert binomial_quantiles(n, 1.0, 5) == [n] * 5 and binomial_quantiles(n, 0.0, 3) == [0] * 3


def _layer(e: int, k: int, resident: float, t: int) -> list[int]:
    missing = max(1, round(e * (1 - resident)))
    counts = binomial_quantiles(t, k / e, e)
    return [c for c in (counts[int((j + 0.5) * e / missing)] for j in range(missing)) if c > 0]


def test_the_threshold_is_where_streaming_stops_losing(rng_seed):
    """At the threshold a layer streams no slower than it places its misses; a step of tokens
    earlier it still placed them faster. Faster links lower it, faster CPUs raise it."""
    rng = random.Random(rng_seed)
    for _ in range(6):
        e, k = rng.choice([(64, 4), (128, 8), (256, 8)])
        expert = rng.choice([3 * 2048 * 768 * 2, 3 * 2048 * 512 * 2, 3 * 1024 * 256 * 2])
        bw = Bandwidths(pcie=rng.uniform(10e9, 60e9), cpu=rng.uniform(20e9, 90e9))
        resident = rng.uniform(0.0, 0.9)
        t = stream_threshold(e, k, expert, bw, resident)
        missing = max(1, round(e * (1 - resident)))
        streamed = missing * expert / bw.pcie
        placed = placed_seconds(_layer(e, k, resident, t), expert, bw, None)
        assert layer_seconds(t, e, k, expert, bw, resident) == (streamed, placed)
        assert streamed <= placed
        if t > STEP:
            assert streamed > placed_seconds(_layer(e, k, resident, t - STEP), expert, bw, None)
        faster_link = Bandwidths(pcie=bw.pcie * 2, cpu=bw.cpu)
        faster_cpu = Bandwidths(pcie=bw.pcie, cpu=bw.cpu * 2)
        assert stream_threshold(e, k, expert, faster_link, resident) <= t
        assert stream_threshold(e, k, expert, faster_cpu, resident) >= t
        # Slots lent as staging stay out of the cache while a chunk streams: it streams them
        # too (placing is unchanged), so streaming pays later.
        staging = rng.uniform(0.0, resident)
        lent_missing = max(1, round(e * (1 - (resident - staging))))
        lent = layer_seconds(t, e, k, expert, bw, resident, staging=staging)
        assert lent == (lent_missing * expert / bw.pcie, placed)
        assert stream_threshold(e, k, expert, bw, resident, staging=staging) >= t


def test_an_engine_may_derive_its_threshold(tmp_path, monkeypatch, rng_seed):
    """The loader derives the threshold from the slots it sizes, with the staging the bank's
    streamer then lends (two buffers of 16 experts, from 48 slots on)."""
    monkeypatch.setenv("FREETOKEN_CACHE", str(tmp_path / "cache"))  # no calibration: defaults
    make_tiny("qwen3_moe", tmp_path / "model", rng_seed, num_experts=16, num_experts_per_tok=4,
              num_hidden_layers=6)  # fmt: skip
    rng = random.Random(rng_seed)
    rows = None
    for lends in (False, True):
        slots = rng.randint(48, rows - 1) if lends else rng.randint(1, 47)
        engine = Engine.load(tmp_path / "model", device="cpu", policy="adaptive",
                             expert_slots=slots, stream_min_tokens=None,
                             progress=False)  # fmt: skip
        spec, bank = engine.spec, engine.loaded.bank
        expert = 3 * spec.hidden_size * spec.moe_intermediate_size * 4  # fp32
        rows = spec.n_moe_layers * spec.n_experts
        assert rows > 48 and bank.streamer.lend == lends
        staging = bank.streamer.n_buffers * spec.n_experts / rows if bank.streamer.lend else 0.0
        want = stream_threshold(spec.n_experts, spec.top_k, expert, Bandwidths(), slots / rows,
                                staging=staging)  # fmt: skip
        assert bank.stream_min_tokens == want
        engine.close()
    with pytest.raises(ValueError, match="stream_min_tokens must be positive"):
        Engine.load(tmp_path / "model", device="cpu", stream_min_tokens=0, progress=False)
