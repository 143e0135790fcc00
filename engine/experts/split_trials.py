"""`adaptive`'s split of misses, chosen by measured decode step time while fills neither pay nor
cost.

q* (policy.py) models the layer as two independent branches, the link at B_P and the CPU at
B_H. On the H200 host they are not independent: running together, the CPU kernel fell from
~73 to ~56 GB/s and the link from ~55 to ~45 GB/s (both read the host's memory), and every fill
costs the driving thread tens of microseconds of host time before the CPU branch can start. So
under near-uniform routing (12 layers, 458 of 1536 slots) q* measured 52 tok/s where fetching
every miss gave 57 and fetching none 55, and which of those wins changes with the machine.

While the fill race (`ExpertCache.fill_gain`) sits between FETCH_NONE_GAIN and FETCH_ALL_GAIN,
a fill's lasting effect on the cache is nil by that measure, so the step it is made in is the
whole of its cost: the fastest way to place this step's misses is the one with the shortest
steps. SplitTrials measures that directly. It runs the candidate modes
- `split`: q* of the misses fetched, the rest on the CPU (split_count),
- `all`: every miss fetched (as `transfer`),
- `none`: only free slots filled, the rest on the CPU (the cache as it is),
- `layers`: the cache made of whole layers, the other layers on the CPU (as `static`;
  layer_layout.py; the first step of its first block pays for the fills, and the median
  leaves that step out),
in turn, for BLOCK decode steps each, ROTATIONS times (interleaved: the H200 host's speed
changes over seconds, so modes measured far apart compare the host with itself), then keeps
the mode with the lowest median seconds per decoded token for PERIOD steps and measures again.
Outside the band the gain decides alone and the steps are not samples (the trials wait).

A mode the caller says cannot win where it stands (`allowed`; adaptive.py refuses `layers`
where few layers miss) is skipped for that measurement.

Which mode runs never changes results: placement only moves where a pair is computed.
Cost: of every EXPLORE + PERIOD steps, at most 3 * BLOCK * ROTATIONS run a mode other than
the best (24 of 288 at the defaults, ~8%), each slower by the margin it loses by; a candidate
already DROP_FACTOR times slower than another runs no more blocks in that measurement. Where
one candidate keeps winning clearly that cost buys nothing, so the period backs off: a
measurement that keeps the same candidate (or the first measurement), ahead of every other by
CLEAR_MARGIN, doubles the next period (up to BACKOFF_CAP periods); any other outcome restores
it. On the H200 host the peer slice's uniform routing measured its three step paths at 13.3 /
12.2 / 6.1 ms a token (twentieth session): re-measured every 256 steps that is ~6% of its
decode time, every 2048 under 1%.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

MODES = ("split", "all", "none", "layers")
BLOCK = 4  # decode steps per mode per rotation
ROTATIONS = 2
PERIOD = 256  # decode steps on the chosen mode before measuring again
CLEAR_MARGIN = 0.25  # a win this far ahead of every other candidate (kept again) backs off
BACKOFF_CAP = 8  # the longest period, in PERIODs
# A candidate whose median so far is this many times another's runs no more blocks in the
# measurement: on the H200 host the peer slice's Zipf b=1 stops path measured 21.3 ms a token
# against the device path's 2.9 (twenty-first session), so its second rotation cost ~4 x 18 ms
# of a 256-token run that takes ~0.7 s. Losses of ~2x kept measuring at 3.0, and they are
# common: the twenty-seventh session's 48-layer uniform b=1 stops path at 67.0 ms a token
# against shared's 31.9 (its second block ~4 x 35 ms of a 128-token run of ~3.7 s), the peer
# slice's native b=1 at 1.91 against 0.95 (adaptive 871 tok/s against gpu-fill's 937, two stops
# blocks and their cache hand-overs in the timed 256 tokens). 1.75 stays above the noise seen
# between two runs' blocks of one path (14.2 against 9.9 ms, 1.43x: step_paths.py). The drop
# reads one block's median (of 3 samples at the defaults): two of them must be 1.75x off to
# drop a winner, and a candidate dropped wrongly costs one period; the schedule's first
# candidate, whose second block is the one the drop saves, opens the next measurement again.
DROP_FACTOR = 1.75


class RotatedTrials:
    """Measures `candidates` by step time: `block` steps of each in turn, `rotations` times
    (the schedule a palindrome of blocks, so that a trend over the measurement favours no
    candidate: `_explore`), keeps the lowest median seconds per token for `period` steps, then
    measures again. SplitTrials' modes here, PathTrials' step paths in step_paths.py,
    OffsetTrials' hill-climbs in offset_trials.py (ShareTrials' shares, CutTrials' cuts);
    subclasses say whether a block's first step is a sample and which blocks run."""

    candidates: tuple[str, ...] = ()
    # Whether a block's first step is a sample (False where it pays for the switch to it).
    first_step_sampled = True

    def __init__(self, block: int, rotations: int, period: int, chosen: str,
                 allowed: Callable[[str], bool] = lambda candidate: True,
                 keepable: Callable[[str], bool] = lambda candidate: True) -> None:  # fmt: skip
        """`allowed(candidate)`: asked as each block of it is due; a block it refuses is
        skipped (a candidate that cannot win where it stands is not paid for). The schedule's
        first block is always run, so every measurement has a candidate to choose.
        `keepable(candidate)`: asked as a measurement ends; the fastest candidate it accepts is
        kept (the fastest of all when it accepts none), for a candidate whose blocks are run
        for what they do beside their time (PathTrials' `stops`: step_paths.py). Asked too
        at each block of a candidate that already ran one in the measurement: one it refuses
        runs one block a measurement (`_spent`)."""
        self.block, self.rotations, self.period = block, rotations, period
        self.allowed, self.keepable = allowed, keepable
        self.chosen = chosen  # the candidate kept between measurements
        self.choices = 0  # measurements completed
        self.period_now = period  # the period after the latest measurement (backed off)
        self._explore()

    @property
    def exploring(self) -> bool:
        return self._exploring

    @property
    def current(self) -> str:
        """The candidate the next step runs."""
        return self._schedule[self._at] if self.exploring else self.chosen

    def step_done(self, seconds_per_token: float) -> None:
        """A step finished, running `current`, at `seconds_per_token`."""
        if not self._exploring:
            self._left -= 1
            if self._left <= 0:
                self._explore()
            return
        if self._is_sample():
            self._samples[self.current].append(seconds_per_token)
        self._at += 1
        self._skip_blocks()
        if self._at == len(self._schedule) and self._late_blocks():
            self._skip_blocks()
        if self._at == len(self._schedule):
            measured = self.medians()
            keep = {c: t for c, t in measured.items() if self.keepable(c)} or measured
            best = min(keep, key=keep.__getitem__)
            # (a faster candidate that may not be kept is no clear win: no back-off)
            others = [t for c, t in measured.items() if c != best]
            clear = bool(others) and min(others) >= (1 + CLEAR_MARGIN) * measured[best]
            # The first measurement has no kept candidate to confirm; a clear first win backs
            # off too. A reply's first few hundred tokens run in the first period, and a second
            # measurement inside them cost the H200 peer slice's uniform b=1 row 13% of its
            # 256 timed tokens (thirty-fourth session); a wrong first choice costs one period.
            if clear and (not self.choices or best == self.chosen):
                self.period_now = min(2 * self.period_now, BACKOFF_CAP * self.period)
            else:
                self.period_now = self.period
            self.chosen = best
            self.choices += 1
            self._exploring, self._left = False, self.period_now

    def medians(self) -> dict[str, float]:
        """Median seconds per token of each candidate measured so far in this measurement."""
        return {c: statistics.median(s) for c, s in self._samples.items() if s}

    def _is_sample(self) -> bool:
        return self.first_step_sampled or self._at % self.block != 0

    def _skip_blocks(self) -> None:
        """At a block's start, pass over the blocks `allowed` refuses now, those of a
        candidate already DROP_FACTOR times slower than another (`_lost`), and the later blocks
        of one that may not be kept (`_spent`)."""
        while 0 < self._at < len(self._schedule) and self._at % self.block == 0:
            candidate = self._schedule[self._at]
            allowed = self.allowed(candidate)
            if allowed and not self._lost(candidate) and not self._spent(candidate):
                break
            if not allowed:
                self._refused.add(candidate)
            self._at += self.block

    def _late_blocks(self) -> bool:
        """At the schedule's end: `rotations` blocks more of each candidate `allowed` refused
        at every turn in this measurement and allows now; whether any were added. PathTrials'
        `shared` waits for the fill race to judge, and only the stops blocks settle races: on
        the H200 the peer slice's uniform b=1 row once kept `device` for a whole period
        because the race judged during the measurement's last stops block, after shared's
        turns (90.9 tok/s against 152.3 in the next round, thirty-fourth session)."""
        late = [c for c in self.candidates
                if c in self._refused and not self._samples[c] and self.allowed(c)]  # fmt: skip
        self._refused.clear()
        self._schedule += [
            c for _ in range(self.rotations) for c in late for _ in range(self.block)
        ]
        return bool(late)

    def _spent(self, candidate: str) -> bool:
        """Whether `candidate` may not be kept and already ran a block in this measurement:
        its time cannot win, so its later blocks only cost (PathTrials' `stops` while fills
        pay: one block a measurement still feeds the fill races, step_paths.py)."""
        return not self.keepable(candidate) and bool(self._samples[candidate])

    def _lost(self, candidate: str) -> bool:
        """Whether `candidate`'s median so far is DROP_FACTOR times another's."""
        measured = self.medians()
        if candidate not in measured or len(measured) < 2:
            return False
        best_other = min(t for c, t in measured.items() if c != candidate)
        return measured[candidate] > DROP_FACTOR * best_other

    def _explore(self) -> None:
        # The schedule is a palindrome of blocks: the first half's rotations start at
        # candidates 0, 1, ... in turn, and the second half is the first reversed (A B C, C B A;
        # A B C, B C A, A C B, C B A), so each candidate's blocks sit in mirrored pairs about
        # the middle and a trend over the measurement moves every median alike. Rotated
        # throughout (A B C, B C A), C ran a block later than B on average: PathTrials' first
        # measurement comes WARM steps after a cold start, with the cache still warming, and
        # measured `shared` (C) after `device` (B) in both rotations (on the H200 the peer
        # slice's Zipf b=1 trials read shared at 2.08 ms a token and device at 3.18, where
        # both run ~2.3 warm: thirty-seventh session; part of that is shared's real lead on a
        # cold cache, where its CPU takes misses the link would fill one by one). An odd
        # rotation count puts its extra rotation in the middle.
        n, half = len(self.candidates), self.rotations // 2
        rotated = [[self.candidates[(r + i) % n] for i in range(n)] for r in range(half + 1)]
        first = [c for rotation in rotated[:half] for c in rotation]
        middle = rotated[half] if self.rotations % 2 else []
        order = first + middle + first[::-1]
        self._schedule = [c for c in order for _ in range(self.block)]
        self._samples: dict[str, list[float]] = {c: [] for c in self.candidates}
        self._refused: set[str] = set()  # candidates `allowed` refused a block of
        self._at, self._exploring, self._left = 0, True, 0
        self._skip_blocks()


class SplitTrials(RotatedTrials):
    candidates = MODES

    def __init__(
        self,
        block: int = BLOCK,
        rotations: int = ROTATIONS,
        period: int = PERIOD,
        allowed: Callable[[str], bool] = lambda mode: True,
    ):
        """`allowed(mode)`: RotatedTrials' (adaptive.py refuses `layers` where it cannot pay)."""
        if block < 1 or rotations < 1 or period < 0:
            raise ValueError(f"split trials need block >= 1, rotations >= 1, period >= 0, got "
                             f"{block}, {rotations}, {period}")  # fmt: skip
        super().__init__(block, rotations, period, chosen="split", allowed=allowed)

    @property
    def mode(self) -> str:
        """The mode for the current step's in-band misses."""
        return self.current
