"""bench offload's rows report the CPU worker's jobs over their own timed steps (not the
worker's totals since it started): how many, their mean time and the tail that stalls a step."""

from __future__ import annotations

import random

import pytest
from tiny_models import make_tiny

from freetoken_agent import Engine
from freetoken_agent.bench import offload
from freetoken_agent.kernels.cpu import worker

pytestmark = pytest.mark.skipif(not worker.available(), reason="no SIMD expert kernel here")


def test_a_decode_window_counts_only_its_own_worker_jobs(tmp_path, rng_seed):
    make_tiny("qwen3_moe", tmp_path, rng_seed, num_experts=16, num_experts_per_tok=4)
    engine = Engine.load(tmp_path, device="cpu", policy="adaptive", expert_slots=6,
                         progress=False, dtype="float32")  # fmt: skip
    bank = engine.loaded.bank
    bank.adaptive.path_params = {"fixed": "shared"}
    bank.adaptive.shared_gate = False
    bank.bandwidths.cpu, bank.bandwidths.pcie = 0.6, 0.4  # the CPU takes most misses
    bank.cpu_share.observe = lambda bandwidths: None  # keep that share
    rng = random.Random(rng_seed)
    try:
        offload._decode(engine, rng.randint(3, 6), rng, batch=1)  # jobs before the window
        before = bank.cpu_share.counters()
        assert before["jobs"] > 0
        _, st = offload._decode(engine, rng.randint(4, 8), rng, batch=rng.randint(1, 2))
        after = bank.cpu_share.counters()
        window = st["worker_jobs"]
        # Only the timed steps' jobs (the prompt's prefill posts none: the share is decode's).
        assert 0 < window["jobs"] == after["jobs"] - before["jobs"] < after["jobs"]
        assert window["mean_job_ms"] == pytest.approx(
            (after["busy_ns"] - before["busy_ns"]) / window["jobs"] / 1e6
        )
        assert 0 <= window["jobs_over_4ms"] <= window["jobs_over_1ms"] <= window["jobs"]
        engine.check_integrity()
    finally:
        engine.close()


def test_the_rows_b_h_observations_are_summarised_per_source(rng_seed):
    """cpu_seen_summary: per source, the count, median and lowest GB/s, how many fell below
    10 GB/s and the median run's MB, from random (source, bytes, seconds) observations."""
    import statistics
    from collections import deque

    rng = random.Random(rng_seed)
    seen = deque()
    for _ in range(rng.randint(5, 40)):
        source = rng.choice(["decode", "prompt", "worker"])
        seen.append((source, rng.uniform(1e6, 1e8), rng.uniform(1e-4, 1e-1)))
    summary = offload.cpu_seen_summary(seen)
    assert set(summary) == {s for s, _, _ in seen}
    for source, got in summary.items():
        rates = [b / t / 1e9 for s, b, t in seen if s == source]
        sizes = [b / 1e6 for s, b, _ in seen if s == source]
        assert got["n"] == len(rates)
        assert got["median_gb_s"] == pytest.approx(statistics.median(rates))
        assert got["min_gb_s"] == pytest.approx(min(rates))
        assert got["below_10_gb_s"] == sum(r < 10 for r in rates)
        assert got["median_mb"] == pytest.approx(statistics.median(sizes))
