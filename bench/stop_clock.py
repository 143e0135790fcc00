"""The host's latency at a decode stop that fills: where the time between a layer's routing
reaching the host and the next segment's launch goes.

A stop with fills (segmented_graphs.py, `resolve`) runs, on the thread driving the step:
  the routing event returns (wake) -> the host decides and issues the first fill's copies ->
  the rest of the fills, the CPU branch and `publish` -> `resolve` returns -> the next
  segment's graph is launched.
The device waits for all of it except what overlaps the copies in flight, so the first
interval (wake -> first fill) is pure latency at every stop, and the last two are latency
where the copies finish before the host does (one or two fills: ~172 us each on the H200
host). `bench profile-offload` reports the mean of each interval in microseconds.
"""

from __future__ import annotations

import time
from collections import defaultdict


class StopClock:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.sums: dict[str, float] = defaultdict(float)
        self.stops = 0  # stops with fills, measured
        self._wake = self._first_fill = self._resolved = None

    def woke(self) -> None:
        """A layer's routing reached the host (its segment's event returned)."""
        self._wake, self._first_fill, self._resolved = time.perf_counter(), None, None

    def filling(self) -> None:
        """A fill's copies are about to be issued."""
        if self._wake is not None and self._first_fill is None:
            self._first_fill = time.perf_counter()

    def resolved(self, missed: bool) -> None:
        """`resolve` returned; a stop with fills waits for the next launch."""
        self._resolved = time.perf_counter() if missed and self._first_fill is not None else None

    def launching(self) -> None:
        """A segment's graph is about to be launched."""
        if self._resolved is None:
            return
        now = time.perf_counter()
        self.sums["wake_to_first_fill"] += self._first_fill - self._wake
        self.sums["first_fill_to_resolved"] += self._resolved - self._first_fill
        self.sums["resolved_to_launch"] += now - self._resolved
        self.stops += 1
        self._wake = self._first_fill = self._resolved = None

    def row(self) -> dict:
        """Mean microseconds a stop with fills, per interval, and how many were measured."""
        n = max(self.stops, 1)
        means = {f"stop_{k}_us": round(1e6 * v / n, 1) for k, v in self.sums.items()}
        return {**means, "stops_with_fills": self.stops}

    def attach(self, bank) -> None:
        """Hook the clock into `bank` (an OffloadedExpertBank): its cache's copies and its
        `resolve` (the events and segments are hooked by the caller's wrappers)."""
        cache, copy_in, resolve = bank.cache, bank.cache._copy_in, bank.resolve

        def timed_copy_in(*args, **kwargs):
            self.filling()
            return copy_in(*args, **kwargs)

        def timed_resolve(*args, **kwargs):
            missed = resolve(*args, **kwargs)
            self.resolved(missed)
            return missed

        cache._copy_in, bank.resolve = timed_copy_in, timed_resolve
