"""The split path's cut, tuned by measured step time around the rates' cut.

SplitExpert.cut (split_expert.py) gives the link columns [0, c) of each split fill, from the
rates: the front columns at about half the link's rate (it carries the copies behind too)
against the CPU worker's at B_H. The step has costs those rates leave out: the worker's
fixed handshake at every split, both halves reading the same host memory, how densely the
splits fall. Measured on the H200 (twenty-ninth session, 48 layers / 32 GB, Zipf 1.0 / loc
0.7, b=1, adaptive held on `split`, I = 768): cuts 576 / 400 / 192 / 96 ran 109.3 / 118.1 /
132.3 / 108.0 tok/s, against 121-125 for gpu-fill. So CutTrials hill-climbs the link's
fraction c / I from the rates' (offset_trials.py): STEP of I a measurement, re-measuring soon
while it moves. Which cut runs never changes results, only which columns cross the link
in the step and which behind it; a change of cut waits for the copies behind in flight
(SplitExpert.enter), so the trials' blocks are long enough to pay for it once each.
"""

from __future__ import annotations

from freetoken_agent.engine.experts.offset_trials import OffsetTrials

STEP = 0.125  # of I: 96 columns at I = 768 (the cut itself moves on multiples of CUT_ALIGN)
MAX_BIAS = 1.0  # anywhere: SplitExpert.cut keeps c within [CUT_ALIGN, I - CUT_ALIGN]
BLOCK = 4  # split steps per offset per rotation; the first is not a sample (it drains)
ROTATIONS = 2
PERIOD = 256  # split steps on the kept cut before measuring again (backed off if clear)
MOVING_PERIOD = 8  # after a measurement that moved the cut


class CutTrials(OffsetTrials):
    what = "cut"

    def __init__(self, block: int = BLOCK, rotations: int = ROTATIONS, period: int = PERIOD,
                 moving_period: int = MOVING_PERIOD) -> None:  # fmt: skip
        super().__init__(STEP, MAX_BIAS, block, rotations, period, moving_period)
