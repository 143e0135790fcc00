"""A hill-climb by measured step time over one number that a model of the rates sets, where
the step has costs the rates leave out: the shared path's CPU share (share_trials.py) and the
split path's cut (cut_trials.py).

OffsetTrials measures three offsets from the kept bias, the current one and one `step` either
side (RotatedTrials: `block` steps each, interleaved, medians; the period and its back-off),
then moves the bias to the fastest, within +-`max_bias`: it holds still once the current
offset wins. A measurement that moved the bias measures again after `moving_period` steps (at
least the one that ends the wait: the climb towards a far optimum then takes a few
measurements, not a few periods); one that held it, or found it at its bounds, waits the
period. Which offset runs never changes results, only where the work goes.
"""

from __future__ import annotations

from freetoken_agent.engine.experts.split_trials import RotatedTrials


class OffsetTrials(RotatedTrials):
    candidates = ("lower", "same", "higher")
    first_step_sampled = False  # a block's first step pays for the change to its offset
    what = "offset"  # for errors: the number the subclass tunes

    def __init__(self, step: float, max_bias: float, block: int, rotations: int, period: int,
                 moving_period: int | None = None) -> None:  # fmt: skip
        moving = period if moving_period is None else moving_period
        if block < 2 or rotations < 1 or period < 0 or moving < 0:
            raise ValueError(f"{self.what} trials need block >= 2, rotations >= 1, period >= 0 "
                             f"and moving_period >= 0, got {block}, {rotations}, {period}, "
                             f"{moving}")  # fmt: skip
        if not 0 < step <= max_bias:
            raise ValueError(f"{self.what} trials need 0 < step <= max_bias, got {step}, "
                             f"{max_bias}")  # fmt: skip
        super().__init__(block, rotations, period, chosen="same")
        self.step, self.max_bias, self.moving_period = step, max_bias, moving
        # Where the offset still changes anything, within +-max_bias: the caller narrows it
        # (a cut pinned at its bounds by a larger offset would leave candidates that tie).
        self.bounds = (-max_bias, max_bias)
        self.bias = 0.0  # the kept offset

    @property
    def offset(self) -> float:
        """The offset for the next step: the kept bias, moved by the candidate measured now."""
        return self._clamp(self.bias + self._move(self.current))

    def step_done(self, seconds_per_token: float) -> None:
        """A step finished at `seconds_per_token`, with `offset` as it stood."""
        choices = self.choices
        super().step_done(seconds_per_token)
        if self.choices > choices:  # a measurement ended: move to the fastest offset
            was = self.bias
            self.bias = self._clamp(self.bias + self._move(self.chosen))
            self.chosen = "same"  # the kept offset is now the bias itself
            if self.bias != was:
                self._left = min(self._left, self.moving_period)

    def _move(self, candidate: str) -> float:
        return {"lower": -self.step, "same": 0.0, "higher": self.step}[candidate]

    def _clamp(self, bias: float) -> float:
        low, high = max(-self.max_bias, self.bounds[0]), min(self.max_bias, self.bounds[1])
        return max(low, min(high, bias)) if low <= high else 0.0
