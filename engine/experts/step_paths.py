"""`adaptive`'s choice of how a decode step reaches its missing experts, by measured step time.

Four paths (engine/experts/device_fills.py, cpu_share.py and split_expert.py have the why):
- `stops`: the segmented graphs stop after each router that misses; the host places the misses
  (q*, fetch-all, the CPU branch, whole layers: adaptive.py) and the step resumes;
- `device`: one graph a step whose layers fill their own misses (policy gpu-fill's kernels):
  no host decision, no CPU branch;
- `shared`: the same graph, its layers sending the CPU worker B_H / (B_P + B_H) of their
  misses, the least used and never all of them while fills pay (cpu_share.py); offered
  where the worker runs (the SIMD kernel built) once the fill race has judged (adaptive.py);
- `split`: the same graph, every fill cut between the link and the CPU worker, which copies
  its part into the slot behind the step (split_expert.py); offered where the worker runs and
  EngineConfig.split_expert asks for it.

Neither wins everywhere. On the H200 host (bench/results/NOTES.md, eighteenth session) the
device path ran native routing at 721 against 543 tok/s on the peer slice and Zipf at 98.9
against 75.1 at 48 layers, while near-uniform routing, where the CPU branch takes half the
misses, ran 86 against 119. So PathTrials times both: BLOCK decode steps of each, ROTATIONS
times (interleaved, as SplitTrials does), keeps the one with the lower median seconds per
token for PERIOD steps (longer while the same path keeps winning clearly: split_trials.py's
back-off), then measures again. The first measurement waits WARM steps on the
device path: a cold cache's first steps fill on whichever path runs them (on the device the
peer slice's uniform routing once measured its stops blocks, the run's first steps among
them, at 14.2 ms a token where another run's took 9.9, and kept the slower path). The wait
runs on the device path because it measured at least as fast as the stops path in every
regime and batch on the H200 host (twentieth session: 48 layers native b=4 1.71-1.81 against
2.08-2.59 ms a token, where the stops path's wait also ran the split trials' slow `split`
blocks at 4.7 ms; the peer slice's uniform routing 12.2 against 13.3), and a fresh engine's
first replies run in it. The first step of every block is not a sample:
it pays the cache's hand-over between host and device (one sync and a rebuild), and under
overlap scheduling the step timed at a block's start is the last one of the block before.
While the paths are measured, the stops path runs its split trials' chosen mode and those
trials wait (adaptive.py `_paths_exploring`).
"""

from __future__ import annotations

from collections.abc import Callable

from freetoken_agent.engine.experts.split_trials import RotatedTrials

PATHS = ("stops", "device", "shared", "split")
DEVICE_PATHS = ("device", "shared", "split")  # the whole-step graph's paths
CPU_PATHS = ("shared", "split")  # the paths whose layers post to the CPU worker
BLOCK = 4  # decode steps per path per rotation; the first is not a sample
ROTATIONS = 2
PERIOD = 256  # decode steps on the chosen path before measuring again
WARM = 16  # decode steps on the stops path before the first measurement


class PathTrials(RotatedTrials):
    first_step_sampled = False  # see the module docstring

    def __init__(
        self,
        block: int = BLOCK,
        rotations: int = ROTATIONS,
        period: int = PERIOD,
        fixed: str | None = None,
        warm: int = WARM,
        shared: bool = True,
        allowed: Callable[[str], bool] = lambda path: True,
        split: bool = False,
        keepable: Callable[[str], bool] = lambda path: True,
    ):
        """`fixed`: always that path, nothing measured (tests of one path's machinery);
        `shared` / `split`: whether those paths are among the candidates; `allowed` and
        `keepable`: RotatedTrials' (adaptive.py refuses `shared` until the fill race has
        judged, and keeps `stops` only while fills do not pay)."""
        offered = {"shared": shared, "split": split}
        self.candidates = tuple(p for p in PATHS if offered.get(p, True))
        if block < 2 or rotations < 1 or period < 0 or warm < 0 or fixed not in (None, *PATHS):
            raise ValueError(f"path trials need block >= 2, rotations >= 1, period >= 0 and a "
                             f"fixed path of {PATHS} or none, got {block}, {rotations}, {period}, "
                             f"{fixed!r}")  # fmt: skip
        self.fixed = fixed is not None
        super().__init__(block, rotations, period, chosen=fixed or "device", allowed=allowed,
                         keepable=keepable)  # fmt: skip
        if warm:  # the first measurement waits
            self._exploring, self._left = False, warm

    @property
    def path(self) -> str:
        """The path for the next decode step."""
        return self.current

    @property
    def exploring(self) -> bool:
        return self._exploring and not self.fixed

    def step_done(self, seconds_per_token: float) -> None:
        """A decode step finished at `seconds_per_token`, on `path` (as it stood)."""
        if not self.fixed:
            super().step_done(seconds_per_token)
