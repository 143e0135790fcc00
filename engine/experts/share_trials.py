"""The CPU's share on adaptive's `shared` path, tuned by measured step time around q*'s.

q* (policy.py `cpu_fraction`) gives the CPU B_H / (B_P + B_H) of a layer's misses, from the
bandwidths each branch showed online. The step has costs the two rates leave out: the worker's
handshake at every layer, the copy kernel's wait for the answer, and the two branches reading
the same host memory (the peer slice's uniform routing moved 489 MB a token at 146.9 tok/s on
the H200, ~72 GB/s averaged over whole steps, against ~85 GB/s for both paths at once). So
ShareTrials measures three offsets of the share, the current one and one STEP either side
(RotatedTrials: BLOCK steps each, interleaved, medians; its period and back-off), and moves the
current one to the fastest: a hill-climb that holds still once the current offset wins, within
+-MAX_BIAS of q*'s share. Which share runs never changes results: it only moves misses between
the link and the CPU.
"""

from __future__ import annotations

from freetoken_agent.engine.experts.split_trials import RotatedTrials

STEP = 0.06  # of a layer's misses: ~one miss of 16 (b=1 at the peer slice: ~4 misses a layer)
MAX_BIAS = 0.3
BLOCK = 4  # shared steps per offset per rotation; the first is not a sample
ROTATIONS = 2
PERIOD = 256  # shared steps on the kept offset before measuring again (backed off if clear)
OFFSETS = {"lower": -STEP, "same": 0.0, "higher": STEP}


class ShareTrials(RotatedTrials):
    candidates = tuple(OFFSETS)
    first_step_sampled = False  # a block's first step pays for the change of share

    def __init__(self, block: int = BLOCK, rotations: int = ROTATIONS, period: int = PERIOD):
        if block < 2 or rotations < 1 or period < 0:
            raise ValueError(f"share trials need block >= 2, rotations >= 1, period >= 0, got "
                             f"{block}, {rotations}, {period}")  # fmt: skip
        super().__init__(block, rotations, period, chosen="same")
        self.bias = 0.0  # the kept offset from q*'s share

    @property
    def offset(self) -> float:
        """The offset from q*'s share for the next shared step."""
        return _clamp(self.bias + OFFSETS[self.current])

    def step_done(self, seconds_per_token: float) -> None:
        """A shared step finished at `seconds_per_token`, with `offset` as it stood."""
        choices = self.choices
        super().step_done(seconds_per_token)
        if self.choices > choices:  # a measurement ended: move to the fastest offset
            self.bias = _clamp(self.bias + OFFSETS[self.chosen])
            self.chosen = "same"  # the kept offset is now the bias itself


def _clamp(bias: float) -> float:
    return max(-MAX_BIAS, min(MAX_BIAS, bias))
