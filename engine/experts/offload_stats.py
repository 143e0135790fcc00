"""OffloadStats: the offloaded expert bank's counters (pairs, hits, fills, misses run on the CPU
or read from the pool), one record the bank, the device's fill counters (device_fills.py) and
the placement of misses (miss_placement.py) all add to.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class OffloadStats:
    """Counters since the last reset, read by `engine.stats()` and the benchmarks."""

    pairs: int = 0  # (token, choice) pairs routed
    experts: int = 0  # distinct (layer, expert) per step, summed
    hits: int = 0
    fetched: int = 0
    on_cpu: int = 0
    direct: int = 0  # misses the kernels read from the pool (direct; gpu-fill with no slot)
    behind: int = 0  # misses run on the CPU and filled behind the layer's compute
    split: int = 0  # fills cut between the link and the CPU (adaptive's `split` path)
    split_hits: int = 0  # hits on cut slots still in flight (their CPU part posted again)

    @property
    def miss_rate(self) -> float:
        return 1.0 - self.hits / self.experts if self.experts else 0.0
