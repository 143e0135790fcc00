"""The stop clock splits a stop with fills into its host intervals, and counts only those."""

from __future__ import annotations

import random

import pytest

from freetoken_agent.bench import stop_clock
from freetoken_agent.bench.stop_clock import StopClock


def test_intervals_of_stops_with_fills(monkeypatch, rng_seed):
    rng = random.Random(rng_seed)
    now = [0.0]
    monkeypatch.setattr(stop_clock.time, "perf_counter", lambda: now[0])

    def later() -> float:
        step = rng.uniform(1e-6, 1e-3)
        now[0] += step
        return step

    clock = StopClock()
    want = {"wake_to_first_fill": 0.0, "first_fill_to_resolved": 0.0, "resolved_to_launch": 0.0}
    counted = 0
    for _ in range(rng.randint(5, 40)):
        kind = rng.choice(["fills", "no fills", "hit"])
        clock.woke()
        if kind == "fills":
            want["wake_to_first_fill"] += later()
            clock.filling()
            gap = sum(later() for _ in range(rng.randint(0, 3)))
            for _ in range(rng.randint(0, 2)):
                clock.filling()  # later fills of the same stop: not the first
            gap += later()
            want["first_fill_to_resolved"] += gap
            clock.resolved(True)
            want["resolved_to_launch"] += later()
            counted += 1
        else:
            later()
            clock.resolved(kind == "no fills")  # a stop run on the CPU alone, or a hit
            later()
        clock.launching()
        later()
        clock.launching()  # the run-ahead segments after it: no stop of their own
    row = clock.row()
    assert row["stops_with_fills"] == counted
    for key, total in want.items():
        if counted:
            assert row[f"stop_{key}_us"] == pytest.approx(1e6 * total / counted, abs=0.06)
    clock.reset()
    assert clock.row() == {"stops_with_fills": 0}
