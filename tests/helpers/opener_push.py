"""Pushing a random demo model to open a tool call: the call opener's logit raised from a drawn
step until the opener is sampled. From then on, until the step is reset, the model samples
freely. Used by the strict-tools generation tests."""

from __future__ import annotations

from typing import Any


class OpenerPush:
    """Wraps `runner_module.sample` (monkeypatched) while the test runs; `reset()` before
    another generation pushes again from step `push_at`."""

    def __init__(self, monkeypatch: Any, runner_module: Any, opener: int, push_at: int) -> None:
        self.opener, self.push_at = opener, push_at
        self.step, self.opened = 0, False
        real_sample = runner_module.sample

        def pushed(logits, params, generators, allowed=None):
            # From the drawn step until the opener comes: a grammar refuses it inside a
            # character (a byte-level token may end halfway through one), so one push may
            # not be taken.
            if self.step >= self.push_at and not self.opened:
                logits[:, self.opener] += 1e4
            self.step += 1
            sampled = real_sample(logits, params, generators, allowed)
            self.opened |= self.opener in sampled.tokens.tolist()
            return sampled

        monkeypatch.setattr(runner_module, "sample", pushed)

    def reset(self) -> None:
        self.step, self.opened = 0, False
