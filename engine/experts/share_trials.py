"""The CPU's share on adaptive's `shared` path, tuned by measured step time around q*'s.

q* (policy.py `cpu_fraction`) gives the CPU B_H / (B_P + B_H) of a layer's misses, from the
bandwidths each branch showed online. The step has costs the two rates leave out: the worker's
handshake at every layer, the MoE sum's wait for the answer, and the two branches reading
the same host memory (the peer slice's uniform routing moved 489 MB a token at 146.9 tok/s on
the H200, ~72 GB/s averaged over whole steps, against ~85 GB/s for both paths at once). So
ShareTrials hill-climbs the share by step time (offset_trials.py), one STEP at a time, within
+-MAX_BIAS of q*'s share. Which share runs never changes results: it only moves misses between
the link and the CPU.
"""

from __future__ import annotations

from freetoken_agent.engine.experts.offset_trials import OffsetTrials

STEP = 0.06  # of a layer's misses: ~one miss of 16 (b=1 at the peer slice: ~4 misses a layer)
MAX_BIAS = 0.3
BLOCK = 4  # shared steps per offset per rotation; the first is not a sample
ROTATIONS = 2
PERIOD = 256  # shared steps on the kept offset before measuring again (backed off if clear)
# After a measurement that moved the share (as the cut's, cut_trials.py): on the H200 the peer
# slice's uniform b=1 rows ran 179.3 tok/s at a share of 0.70 and 132.6 at 0.49, both on
# `shared` for all their 256 steps, q* near 0.55 (thirty-fifth session): a period a STEP, the
# climb to the faster share took longer than a row, and longer than a user's reply.
MOVING_PERIOD = 8


class ShareTrials(OffsetTrials):
    what = "share"

    def __init__(self, block: int = BLOCK, rotations: int = ROTATIONS, period: int = PERIOD,
                 moving_period: int = MOVING_PERIOD) -> None:  # fmt: skip
        super().__init__(STEP, MAX_BIAS, block, rotations, period, moving_period)
