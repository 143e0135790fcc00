"""Drive an OffsetTrials hill-climb (engine/experts/offset_trials.py) with synthetic steps."""

from __future__ import annotations

import random


def climb(trials, best: float, rng: random.Random, measurements: int) -> list[tuple[int, float]]:
    """Feed steps whose time grows with the offset's distance from `best` (1% noise) until
    `measurements` measurements ended; returns (steps fed so far, bias) after each."""
    ends, steps = [], 0
    while len(ends) < measurements:
        choices = trials.choices
        trials.step_done((1.0 + 4 * abs(trials.offset - best)) * rng.uniform(0.995, 1.005))
        steps += 1
        if trials.choices > choices:
            ends.append((steps, trials.bias))
    return ends
