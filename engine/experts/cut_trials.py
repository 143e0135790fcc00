"""The split path's cut, tuned by measured step time around the rates' cut.

SplitExpert.cut (split_expert.py) gives the link columns [0, c) of each split fill, c / I =
B_P / (B_P + B_H), so that the link's part and the CPU worker's would take equal times at the
two rates. The step has costs those rates leave out, and on the H200 they fall on the link's
side: the copy kernel's part runs beside the copier's copies behind of the layers before (the
same link) and the worker's reads of the same host memory, while the worker's part pays a
fixed handshake whatever its width. Measured there (twenty-ninth session, 48 layers / 32 GB,
Zipf 1.0 / loc 0.7, b=1, adaptive held on `split`, I = 768): cuts 576 / 400 (the rates') /
192 ran 109.3 / 118.1 / 132.3 tok/s, against 121.6 for gpu-fill.

So CutTrials hill-climbs the link's fraction c / I (offset_trials.py): STEP of I a
measurement, re-measuring soon while it moves, from START_BIAS below the rates' (the H200's
best: the path trials time `split` against the other paths at the cut it starts with, before
its own trials run). Which cut runs never changes results, only which columns cross the link
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
START_BIAS = -0.25  # of I: the H200's best cut at 48 layers, 192 of 768, where the rates' was ~400


class CutTrials(OffsetTrials):
    what = "cut"

    def __init__(self, block: int = BLOCK, rotations: int = ROTATIONS, period: int = PERIOD,
                 moving_period: int = MOVING_PERIOD,
                 start: float = START_BIAS) -> None:  # fmt: skip
        super().__init__(STEP, MAX_BIAS, block, rotations, period, moving_period, start)
