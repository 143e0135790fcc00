"""The CPU's share of the device path's misses (adaptive's `shared` step path).

Why: the device path (device_fills.py) moves every miss over the link, one expert at ~180 us,
while the host's memory can feed the CPU's SIMD kernel about as fast again (DESIGN section 7:
52 GB/s over the link and 66 GB/s by the CPU at the same time on the H200 host). The stops
path uses both, but stops the step at every layer that misses for a host decision (~120 us).
Here the decision stays on the device: each layer's plan sends the CPU share of its misses
(CPU_SHARE; never all of them while fills pay, and the least used:
kernels/reference_fills.py `cpu_misses`) to a worker thread through a pinned mailbox
(kernels/cpu/worker.py) and copies the rest; the MoE sum over k then waits for the worker's
answer and adds it (kernels/triton/cpu_answer.py), after the copies and the MoE kernels of the
slots' experts. No step stops for Python.

The share balances the two branches as q* does (policy.py): the CPU takes
B_H / (B_P + B_H) of a layer's misses, from the bank's bandwidth estimates, which the worker's
own timings keep current (`observe`). The CPU's misses take no slot: that is the price when
routing repeats itself (fills pay), which the choice of misses keeps small (a layer keeps a
fill; the CPU takes the least used), and PathTrials measures this path against the others
(adaptive.py `_path_allowed`). Measured on the H200 (nineteenth session): near-uniform
routing on the peer slice at b=1 ran 129-139 tok/s against 85 on the device path and 100 for
`static`.

Shapes: T_max = the bank's device_tokens, K top-k, H hidden. The answer (the mailbox's out
[T_max, H] fp32, pinned) enters the MoE kernels' fp32 sum before its one rounding.
"""

from __future__ import annotations

import torch

from freetoken_agent.engine.experts import calibration
from freetoken_agent.engine.experts.policy import Bandwidths, cpu_fraction
from freetoken_agent.engine.experts.pool import ExpertPool
from freetoken_agent.kernels.cpu import worker
from freetoken_agent.kernels.cpu.worker import BUSY_NS, ERROR, EXPERTS, LOST, TIMEOUT, CpuWorker
from freetoken_agent.kernels.reference_fills import SHARE_ONE, CpuPost


class CpuShareFailed(RuntimeError):
    """The worker did not answer (or could not run a job): the steps since the last check
    miss the CPU's part of some layers."""


class CpuShare:
    def __init__(self, pool: ExpertPool, device: torch.device, max_tokens: int, top_k: int,
                 hidden: int) -> None:  # fmt: skip
        """After the pool is in its final place (pinned: `ExpertPool.pin` may move it)."""
        dtype = pool.w13.dtype
        self.box = worker.Mailbox.allocate(max_tokens, top_k, hidden, dtype,
                                           pin=device.type == "cuda")  # fmt: skip
        self.worker = CpuWorker(self.box, pool.w13, pool.w2)
        self.expert_bytes = pool.expert_bytes
        self.width = pool.w2.shape[2]  # I: a job's COLUMNS / I experts' bytes were read
        self.broken: str | None = None  # why the share is off for good
        self.timeout_s = worker.TIMEOUT_S  # a device wait's bound (the MoE sum's)
        self._lost = 0  # ctrl[LOST] last reported
        self._seen = (0, 0)  # (columns, busy ns) already folded into B_H

    @staticmethod
    def possible() -> bool:
        return worker.available()

    def post(self, hidden: torch.Tensor, weights: torch.Tensor) -> CpuPost:
        """A layer's post for the plan: hidden [T, H], weights [T, K] fp32."""
        return CpuPost(self.box, hidden.contiguous(), weights)

    def fixed_share(self, bandwidths: Bandwidths, offset: float = 0.0,
                    held: float | None = None) -> int:  # fmt: skip
        """CPU_SHARE (1/SHARE_ONE) for the estimates: B_H / (B_P + B_H), moved by `offset`
        (adaptive's share trials), or `held` (a fraction, adaptive.held_share) where given;
        within [0, 1]; 0 once broken."""
        if self.broken is not None:
            return 0
        fraction = cpu_fraction(bandwidths) + offset if held is None else held
        return round(min(1.0, max(0.0, fraction)) * SHARE_ONE)

    def wake(self) -> None:
        if self.broken is None:
            self.worker.wake()

    def observe(self, bandwidths: Bandwidths) -> None:
        """Fold the worker's jobs since the last call into B_H (no sync: host memory)."""
        ctrl = self.box.ctrl
        now = int(ctrl[worker.COLUMNS]), int(ctrl[BUSY_NS])
        columns, ns = now[0] - self._seen[0], now[1] - self._seen[1]
        self._seen = now
        if columns > 0:
            nbytes = columns * self.expert_bytes / self.width
            calibration.observe_cpu(bandwidths, "worker", nbytes, ns / 1e9)

    def check(self) -> None:
        """After a step: raise CpuShareFailed when a layer's CPU part went missing since the
        last check (a wait gave up: ctrl[LOST]) or a job failed; the share is then off for
        good (the plans send the CPU nothing). A step already queued with a share (overlap
        scheduling) finds the mailbox dead, loses its parts at once, and raises too."""
        ctrl = self.box.ctrl
        timeout, error, lost = int(ctrl[TIMEOUT]), int(ctrl[ERROR]), int(ctrl[LOST])
        if lost == self._lost and (error == 0 or self.broken is not None):
            return
        self._lost = lost
        if self.broken is None:
            what = (f"failed a job (code {error})" if error
                    else f"did not answer job {timeout} within {self.timeout_s:g} s (the device "
                    f"last read answer {int(ctrl[worker.GAVE_UP_AT])}; {int(ctrl[worker.JOBS])} "
                    f"jobs answered, the longest in "
                    f"{int(ctrl[worker.MAX_JOB_NS]) / 1e6:.2f} ms)")  # fmt: skip
            self.broken = f"the CPU expert worker {what}"
            self.worker.stop()
            if timeout == 0:  # the steps already queued (overlap) give up at once, not in 2 s
                ctrl[TIMEOUT] = -1
        raise CpuShareFailed(
            f"{self.broken}: this step's outputs miss the CPU's part of some layers; the CPU "
            "share of the device path is off from now on"
        )

    def counters(self) -> dict[str, int]:
        """The worker's running totals (a benchmark's window is the difference of two)."""
        ctrl = self.box.ctrl
        return {"jobs": int(ctrl[worker.JOBS]), "busy_ns": int(ctrl[BUSY_NS]),
                "jobs_over_1ms": int(ctrl[worker.SLOW_JOBS]),
                "jobs_over_4ms": int(ctrl[worker.STALLED_JOBS])}  # fmt: skip

    def stats(self, share: int) -> dict:
        """For Engine.stats: the worker's jobs and experts, the share the plans read now, its
        cores and the threads pinned there (None until the worker knows)."""
        ctrl = self.box.ctrl
        pinned = int(ctrl[worker.PINNED]) if int(ctrl[worker.PINS_KNOWN]) else None
        return {**job_summary(self.counters()), "experts": int(ctrl[EXPERTS]),
                "share": share / SHARE_ONE, "broken": self.broken,
                "max_job_ms": int(ctrl[worker.MAX_JOB_NS]) / 1e6,
                "cores": self.worker.cpus, "pinned": pinned}  # fmt: skip

    def close(self) -> None:
        self.worker.stop()


def job_summary(counters: dict[str, int]) -> dict:
    """`counters` (totals, or the difference of two) as jobs, their mean time and the tail:
    jobs past 1 ms, and past 4 ms (a lost time slice: kernels/cpu/worker.py)."""
    jobs = counters["jobs"]
    return {"jobs": jobs, "mean_job_ms": counters["busy_ns"] / max(jobs, 1) / 1e6,
            "jobs_over_1ms": counters["jobs_over_1ms"],
            "jobs_over_4ms": counters["jobs_over_4ms"]}  # fmt: skip
