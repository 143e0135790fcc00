"""bench offload's rows report the CPU worker's jobs over their own timed steps (not the
worker's totals since it started): how many, their mean time and the tail that stalls a step."""

from __future__ import annotations

import random

import pytest
from tiny_models import make_tiny

from freetoken_agent import Engine
from freetoken_agent.bench.offload_decode import decode_window, use_policy
from freetoken_agent.bench.offload_summaries import (
    cpu_seen_summary,
    step_times_summary,
    trial_positions,
)
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
        decode_window(engine, rng.randint(3, 6), rng, batch=1)  # jobs before the window
        before = bank.cpu_share.counters()
        assert before["jobs"] > 0
        _, st = decode_window(engine, rng.randint(4, 8), rng, batch=rng.randint(1, 2))
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
    summary = cpu_seen_summary(seen)
    assert set(summary) == {s for s, _, _ in seen}
    for source, got in summary.items():
        rates = [b / t / 1e9 for s, b, t in seen if s == source]
        sizes = [b / 1e6 for s, b, _ in seen if s == source]
        assert got["n"] == len(rates)
        assert got["median_gb_s"] == pytest.approx(statistics.median(rates))
        assert got["min_gb_s"] == pytest.approx(min(rates))
        assert got["below_10_gb_s"] == sum(r < 10 for r in rates)
        assert got["median_mb"] == pytest.approx(statistics.median(sizes))


def test_the_rows_step_times_are_summarised_per_label(rng_seed):
    """step_times_summary: per label, the count, mean, median, 90th percentile and longest
    step in ms, and the label's share of the window, from random labelled step times."""
    import statistics

    rng = random.Random(rng_seed)
    labels = [rng.choice(["shared", "device~", "stops~"]) for _ in range(rng.randint(5, 60))]
    seconds = [rng.uniform(1e-4, 2e-2) for _ in labels]
    summary = step_times_summary(labels, seconds)
    assert set(summary) == set(labels)
    assert sum(got["n"] for got in summary.values()) == len(labels)
    assert sum(got["time_share"] for got in summary.values()) == pytest.approx(1.0)
    for label, got in summary.items():
        ms = sorted(1e3 * s for lab, s in zip(labels, seconds, strict=True) if lab == label)
        assert got["n"] == len(ms)
        assert got["mean_ms"] == pytest.approx(statistics.fmean(ms))
        assert got["median_ms"] == pytest.approx(statistics.median(ms))
        assert got["max_ms"] == pytest.approx(ms[-1])
        assert ms[0] <= got["p90_ms"] <= ms[-1]
        assert sum(m <= got["p90_ms"] for m in ms) >= 0.9 * len(ms)
        assert got["time_share"] == pytest.approx(sum(ms) / 1e3 / sum(seconds))


def test_a_decode_window_labels_each_step_with_adaptives_path(tmp_path, rng_seed):
    """The row's steps carry the path adaptive ran them on: held on one path, every step is
    that path's, none a trial's; the intervals add up to the window."""
    make_tiny("qwen3_moe", tmp_path, rng_seed, num_experts=16, num_experts_per_tok=4)
    engine = Engine.load(tmp_path, device="cpu", policy="adaptive", expert_slots=6,
                         progress=False, dtype="float32")  # fmt: skip
    rng = random.Random(rng_seed)
    path = rng.choice(["device", "stops"])
    engine.loaded.bank.adaptive.path_params = {"fixed": path}
    try:
        n, batch = rng.randint(4, 9), rng.randint(1, 2)
        rate, st = decode_window(engine, n, rng, batch=batch)
        steps = st["step_ms"]
        assert set(steps) == {path}
        assert steps[path]["n"] == n  # (one step a token of each sequence)
        window_ms = 1e3 * st["tokens"] / rate  # (n - 1 tokens each: the first is the prefill's)
        assert steps[path]["mean_ms"] * n == pytest.approx(window_ms, rel=0.05)
        # another policy on the same bank: plain steps, not adaptive's idle path
        use_policy(engine, engine.loaded.bank, rng.choice(["transfer", "cpu"]))
        _, st = decode_window(engine, n, rng, batch=batch)
        assert set(st["step_ms"]) == {"step"} and st["step_ms"]["step"]["n"] == n
    finally:
        engine.close()


def test_trial_steps_are_summarised_by_their_place_in_a_block(rng_seed):
    """trial_positions: for each trial label, the median ms at each place of its blocks (runs
    of one label), from random blocks of random lengths; steps off trial add nothing."""
    import statistics

    rng = random.Random(rng_seed)
    labels, places = [], []
    for _ in range(rng.randint(3, 12)):
        label = rng.choice(["shared~", "device~", "stops~", "device"])
        if labels and labels[-1] == label:  # (two blocks of one label would be one run)
            continue
        for place in range(rng.randint(1, 6)):
            labels.append(label)
            places.append(place)
    seconds = [rng.uniform(1e-4, 2e-2) for _ in labels]
    got = trial_positions(labels, seconds)
    assert set(got) == {label for label in labels if label.endswith("~")}
    for label, medians in got.items():
        for place, median in enumerate(medians):
            ms = [1e3 * s for lab, p, s in zip(labels, places, seconds, strict=True)
                  if lab == label and p == place]  # fmt: skip
            assert median == pytest.approx(statistics.median(ms))
        assert len(medians) == 1 + max(
            p for lab, p in zip(labels, places, strict=True) if lab == label
        )
