"""The expert cache's hit clock: a step count and the step of each lid's last hit, which the
MemoryManager reads as the cold tail's worth (how many of the least recently used residents
were hit lately: what giving up slots would lose).

The MemoryManager ticks it once a safe point (`ExpertCache.tick`); the cache stamps a lid at
each hit (`ExpertCache.touch`), and a hand-back from the device stamps the lids used there
(device_fills.py). It lives apart from cache.py because it serves the elastic split's
decisions, not the fills: no fill or eviction reads it.
"""

from __future__ import annotations

from collections.abc import Collection

import numpy as np

# N = L * E lids

NEVER = -(1 << 62)  # the last-hit step of a lid never hit


class HitClock:
    def __init__(self, n_lids: int) -> None:
        self.step = 0  # engine steps begun (`tick`)
        self.last_hit: list[int] = [NEVER] * n_lids  # [N] the step of each lid's last hit
        # The step the host's mirror was last the truth at: the device's last `own` or
        # hand-back (tail_profile reads a stale mirror as of then).
        self.mirror_step = 0

    def tick(self) -> None:
        """One engine step begins: hits from now on count for this step."""
        self.step += 1

    def tail_profile(self, lids: Collection[int], window: int, now: int) -> np.ndarray:
        """hot[k]: how many of the k least recently used resident lids (`lids`, least recent
        first) were hit within the `window` steps up to `now` (hot[0] = 0), for every k at
        once: [resident + 1] int64. One O(slots) pass, the counting in numpy (~0.12 ms for
        4,000 slots on the CPU here against ~0.2 ms for the Python walk it replaced). The
        MemoryManager reads hot[k] / window as the hits per step that giving up k slots would
        lose."""
        last = np.fromiter(map(self.last_hit.__getitem__, lids), np.int64, len(lids))
        hot = np.zeros(len(lids) + 1, np.int64)
        np.cumsum(last > now - window, out=hot[1:])
        return hot
