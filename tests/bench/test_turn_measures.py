"""The per-turn measures the elastic bench adds beside tok/s: the spread of decode steps, the
garbage collector's time, and a host profile per step."""

import cProfile
import gc
import random
import statistics

from freetoken_agent.bench.elastic_turn import GcClock, host_profile, step_spread


def test_step_spread_reports_median_tail_and_slowest():
    rng = random.Random()
    steps = [rng.uniform(0.01, 0.02) for _ in range(rng.randrange(20, 200))]
    stall = rng.uniform(0.2, 0.5)
    steps.insert(rng.randrange(len(steps)), stall)
    out = step_spread(steps)
    assert abs(out["step_p50_ms"] - 1e3 * statistics.median(steps)) < 1e-9
    assert out["step_max_ms"] == 1e3 * stall
    assert 10 <= out["step_p90_ms"] <= 20  # one stall does not move the 90th percentile
    assert step_spread([]) == {"step_p50_ms": None, "step_p90_ms": None, "step_max_ms": None}


def test_gc_clock_times_collections_only_while_installed():
    with GcClock() as clock:
        junk = [[i] for i in range(random.randrange(10_000, 20_000))]
        gc.collect()
    assert clock.collections >= 1 and clock.seconds > 0
    seen = clock.collections
    gc.collect()
    del junk
    assert clock.collections == seen, "counted a collection after it was removed"
    assert clock not in gc.callbacks


def _work(n: int) -> int:
    return sum(range(n))


def test_host_profile_is_per_step():
    steps, calls = random.randrange(3, 9), random.randrange(2, 6)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        for _ in range(calls):
            _work(50_000)
    prof.disable()
    top = host_profile(prof, steps, top=50)
    row = next(r for r in top if r["function"].endswith("(_work)"))
    assert row["calls_per_step"] == calls
    assert row["cum_us_per_step"] >= row["own_us_per_step"] > 0
    assert [r["own_us_per_step"] for r in top] == sorted(
        (r["own_us_per_step"] for r in top), reverse=True
    )
