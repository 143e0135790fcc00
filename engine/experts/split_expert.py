"""adaptive's `split` step path: every fill cut between the link and the CPU worker.

Why: on the device path a layer that misses waits for its whole expert to cross the link
(9.44 MB, ~185 us at 48 layers / 32 GB), and at b=1 under Zipf routing nearly every missing
layer misses one expert, which the shared path cannot split: the CPU computes one expert no
faster than the link fills it. SwiGLU is elementwise over the width I, so an expert's output
is the sum of its column slices' outputs. Here each fill moves columns [0, c) over the link
while the CPU worker computes columns [c, I) from the pool (kernels/reference_fills.py has the
plan's rule), so the layer waits for about half an expert. Then a copier thread copies the
CPU's columns into the slot behind the step with the copy engines (kernels/cpu/worker.py's
copies behind; behind_copier.cpp) so the cache keeps whole experts, and writes `landed`; until
then the slot is in flight: no victim, and a hit on it posts its columns past the cut again.

Why the copy engines, issued by a CPU thread: bench side-fill (twenty-eighth session, 48
layers, 25 misses a step) measured them nearly free beside the step (the half step 6.01 ms,
with the other halves behind on the copy engines 6.17-6.25, the whole fills 8.34), where an SM
copy kernel on a second stream cost almost all of the saving (7.09-8.13 ms): its programs take
SMs and the link from the step. Only the host side knows the addresses. Not the worker itself:
the device spins on its answers, and its own driver calls stalled them (up to 20 ms a job,
once past the 2 s timeout, on the H200), so a thread of its own.

The cut balances the two halves: the link's c / I of an expert against the CPU's (I - c) / I
at B_H. Not at the link's whole rate B_P: every split expert crosses the link whole, its
columns past the cut behind the step, so in a step of splits the link carries a layer's front
columns beside the copies behind of the layers before, and the front gets about half of it
(FRONT_SHARE). Hence c / I = s B_P / (s B_P + B_H), on a multiple of CUT_ALIGN. On the H200
(twenty-ninth session, 48 layers / 32 GB, Zipf b=1, I = 768) cuts 576 / 400 (the whole rate's
at B_H ~ 52 GB/s) / 192 / 96 ran 109 / 118 / 132 / 108 tok/s: the half share's cut there is
~250, and ~185 at the B_H of 82 GB/s another probe measured. Adaptive's cut trials
(cut_trials.py) move the cut from there by step time. It changes only while no slot is in
flight: a new cut, a step on another path and a hand-back to the host first `drain` the
copies behind (every slot whole again).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from freetoken_agent.engine.experts.policy import Bandwidths
from freetoken_agent.kernels.cpu.behind_copies import BehindCopies
from freetoken_agent.kernels.cpu.worker import BEHIND_ERROR

if TYPE_CHECKING:
    from freetoken_agent.engine.experts.cpu_share import CpuShare
    from freetoken_agent.engine.experts.device_fills import DeviceFills
    from freetoken_agent.engine.experts.pool import ExpertPool

log = logging.getLogger("freetoken.experts")

CUT_ALIGN = 16  # columns: the cut stays on whole 32-byte rows of bf16 for both halves
FRONT_SHARE = 0.5  # of B_P: the link's rate for a split's front columns (the copies behind)

# S slots, I expert width


class SplitExpert:
    def __init__(self, fills: DeviceFills, share: CpuShare, pool: ExpertPool,
                 w13: torch.Tensor, w2: torch.Tensor) -> None:  # fmt: skip
        """`w13` [S, 2I, H], `w2` [S, H, I]: the cache's slot banks (the copies' targets)."""
        self.fills, self.share = fills, share
        self.width = pool.w2.shape[2]  # I
        self.tables = fills.enable_split(self.width)
        self.behind = BehindCopies.to_slots(w13, w2, self.tables.landed)
        share.worker.set_behind(self.behind)
        fills.before_release = self.drain
        self.dirty = False  # a split step ran since the last drain: slots may be in flight
        self._link = 0.5  # the rates' link fraction, read by `enter` with nothing in flight
        self.failed: str | None = None  # why the path is off for good (`check`)

    def cut(self, bandwidths: Bandwidths, offset: float = 0.0) -> int:
        """The column c for the link's part: I * s B_P / (s B_P + B_H) (s = FRONT_SHARE),
        moved by `offset` of I (adaptive's cut trials: cut_trials.py), on a multiple of
        CUT_ALIGN within [CUT_ALIGN, I - CUT_ALIGN] (the middle where I is narrower)."""
        return self._cut_at(_link_fraction(bandwidths) + offset)

    def _cut_at(self, link: float) -> int:
        i = self.width
        if i < 2 * CUT_ALIGN:
            return max(1, i // 2)
        c = round(i * link / CUT_ALIGN) * CUT_ALIGN
        return min(i - CUT_ALIGN, max(CUT_ALIGN, c))

    def check(self) -> bool:
        """After a step: whether the path may still run. A copy behind that failed (the
        copier's BEHIND_ERROR: the answers were right, only slots stay unfinished) turns it off
        for good; the next drain evicts those slots. The CPU share goes on."""
        if self.failed is None:
            code = int(self.share.box.ctrl[BEHIND_ERROR])
            if code != 0:
                self.failed = f"a copy behind failed (code {code})"
                log.warning("the split path is off: %s", self.failed)
        return self.failed is None and self.share.broken is None

    def offset_span(self, bandwidths: Bandwidths) -> tuple[float, float]:
        """The offsets of I within which the cut still moves, from the rates' link fraction as
        `enter` holds it (past them it stays at CUT_ALIGN or I - CUT_ALIGN)."""
        link = self._rates_link(bandwidths)
        edge = CUT_ALIGN / self.width
        return edge - link, 1.0 - edge - link

    def _rates_link(self, bandwidths: Bandwidths) -> float:
        """The rates' link fraction a split step uses: the one held while slots are in flight,
        else the bandwidths' now."""
        return self._link if self.dirty else _link_fraction(bandwidths)

    def enter(self, bandwidths: Bandwidths, offset: float = 0.0) -> None:
        """Before a split step: the cut, the rates' (read again only with nothing in flight:
        their estimates move a little every step, and each change of cut drains; not after
        the drain a new offset makes either, so the cut trials' candidates stay comparable)
        moved by `offset` of I. A new offset (the cut trials' next block) drains first."""
        self._link = self._rates_link(bandwidths)
        cut = self._cut_at(self._link + offset)
        if cut != self.fills.cut and self.dirty:
            self.drain()  # the slots in flight hold the old cut's columns
        self.fills.set_cut(cut)
        self.dirty = True

    def drain(self) -> None:
        """Wait until every copy behind has landed, then call every slot whole (a no-op
        when no split step ran since the last drain). A slot still in flight then never gets
        its columns (a copy the copier refused or dropped, a driver error, a worker that
        failed): it loses its expert instead, which misses again, rather than serve the last
        expert's columns past the cut."""
        if not self.dirty:
            return
        if self.behind.on_cuda:
            # A split step may still run (overlap scheduling queues the next step before the
            # last one ends) and post more columns: every post must be in before the drain.
            torch.cuda.synchronize(self.behind.w13.device)
        if self.share.broken is None:
            self.share.worker.drain_behind(self.share.timeout_s)
        # (a failed worker's copier finished its queue when the worker stopped)
        self._evict_in_flight()
        self.tables.cols.fill_(self.width)  # in stream order, before the next step's plans
        self.dirty = False

    def _evict_in_flight(self) -> None:
        """Empty the slots whose copies behind never came (the device tables are the truth
        here: the cache is the device's until `release` reads them)."""
        fills = self.fills
        gone = self.tables.in_flight(fills.lid_of)  # [S] bool
        lids = fills.lid_of[gone].long()
        fills.cache.slot_of[lids] = -1
        fills.lid_of[gone] = -1
        fills.stamp[gone] = -1
        fills.popular[gone] = False  # (an empty slot is pinned for nothing)

    def close(self) -> None:
        """Stop the copies behind (after a drain: the worker is stopped next)."""
        self.drain()
        self.fills.before_release = None
        if self.share.worker.running:  # (a stopped worker copies nothing more anyway)
            self.share.worker.set_behind(None)


def _link_fraction(bandwidths: Bandwidths) -> float:
    """c / I at the rates: the front columns at FRONT_SHARE of B_P against the CPU's at B_H."""
    front = FRONT_SHARE * bandwidths.pcie
    return front / (front + bandwidths.cpu)
