"""The CPU branch of a whole-step decode graph: a mailbox in pinned host memory and the thread
that answers it (expert_worker.cpp, built into the CPU kernel's library).

A captured decode step cannot stop for the host, so the device posts a layer's CPU share here
(kernels/expert_fills.py: the plan's post; kernels/triton/cpu_answer.py: the MoE sum's wait)
and this thread computes it from the pool while the link copies the rest. The protocol, one job
outstanding at a time:

    device: tokens, rows, weights, hidden (and the job's columns of I, COL_LO / COL_HI, 0 / 0
            for whole experts) written; then ctrl[POST] = seq (release, sys scope)
    worker: sees POST change; out = ft_cpu_experts(...) over those columns; JOBS, EXPERTS,
            COLUMNS, BUSY_NS counted; ctrl[ANSWER] = seq (release)
    device: spins until ctrl[ANSWER] == seq (acquire, sys scope), then reads out.

The split expert's copies behind (on after `CpuWorker.set_behind(BehindCopies)`; behind_copies.py):
each pair p with fill_slots[p] >= 0 (and rows[p] >= 0) names the cache slot its expert's
columns [COL_LO, COL_HI) go to. The worker thread calls no CUDA (a driver call can block on a
lock another thread holds while the device spins on the next answer): before ANSWER it
snapshots the job's (row, slot) pairs into a ring, after ANSWER it pushes the job there and
goes back to the mailbox. A second thread of the worker, the copier (behind_copier.cpp),
takes the jobs in order, copies those columns of pool row rows[p] into the slot, each slot once
per job, then landed[slot] = rows[p] behind them (CUDA: queued on the side stream, they land
later; `drain_behind` waits for them), then release-stores ctrl[BEHIND] = seq and adds the
slots to ctrl[BEHIND_EXPERTS]. Every answered job is pushed while copies behind are on (jobs
without fills and failed jobs, which copy nothing, too), so BEHIND advances in order. The ring
holds RING jobs (`set_behind(ring=...)`); on a full ring the worker does not wait: it drops
the job's copies (BEHIND_ERROR -7) and the copier stores BEHIND = that seq once the ring is
empty, so a drain still ends. The copier sleeps when idle (1 ms slices; the worker wakes it
after a push).

A device wait that outlives TIMEOUT_S writes its seq to ctrl[TIMEOUT] (the mailbox is dead
from then on: later waits do not spin) and every wait that gives up writes its seq to
ctrl[LOST] (that layer's CPU part is missing: the bank raises for the step and stops sharing,
engine/experts/cpu_share.py). ctrl[ERROR] holds the kernel's nonzero return code (-1 a row past
the pool, -2 a dtype, -4 a column range; -3 more tokens than the mailbox holds) and
ctrl[BEHIND_ERROR] a copy behind's: -5 a fill slot outside the slot bank (that pair copies
nothing), -6 one slot named for two rows in a job (the first pair's row is copied), -7 a job's
copies dropped (the copier's ring was full: the copier far behind, e.g. blocked in the
driver), -100 - r a CUDA driver call's CUresult r (the job's copies stop there). A failed
job's copies are not made.

Shapes: T_max tokens, K top-k, H hidden. rows [T_max * K] int64 (pool rows, -1: not the CPU's),
weights [T_max * K] fp32, hidden [T_max, H] (the model's dtype), out [T_max, H] fp32,
fill_slots [T_max * K] int64 (cache slots, -1: no copy behind).
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import time
import weakref
from dataclasses import dataclass

import torch

from freetoken_agent.kernels.cpu import experts
from freetoken_agent.kernels.cpu.behind_copies import BehindCopies

log = logging.getLogger("freetoken.experts")

# ctrl's entries (expert_worker.cpp has the same): the device writes POST, TOKENS, TIMEOUT,
# LOST and GAVE_UP_AT; the worker ANSWER, BEHIND, ERROR and the counters. POST and ANSWER sit on
# different cache lines.
POST, TOKENS, ANSWER, ERROR, TIMEOUT, JOBS, EXPERTS, BUSY_NS, LOST = 0, 1, 8, 9, 10, 11, 12, 13, 14
# A job's columns of I, [COL_LO, COL_HI) (the split expert's CPU half; COL_HI 0: the whole
# width), written by the device with the job; COLUMNS counts distinct experts x columns computed
# (the pool bytes read are COLUMNS / I experts' worth).
COL_LO, COL_HI, COLUMNS = 3, 4, 5
# The copies behind (set_behind): the last job whose copies are all queued (the copier's), and
# the slots copied (each slot once per job); BEHIND_ERROR, a copy behind's failure, apart from
# ERROR: every answer was right, only a cache slot stays unfinished (the engine then turns the
# split path off and evicts its slots in flight; the CPU share goes on).
BEHIND, BEHIND_EXPERTS, BEHIND_ERROR = 6, 7, 16
# The copier's ring in jobs: about five 48-layer steps of one job per layer before the worker
# drops copies; each entry holds T_max * K pairs of 16 bytes, made once.
RING = 256
# Diagnostics: the longest job (ns), and the answer a wait last read when it gave up.
MAX_JOB_NS, GAVE_UP_AT = 15, 2
# The jobs' tail: how many took over SLOW_JOB_NS and over STALL_NS. A decode layer waits for
# its job, so a job of ~0.2 ms that takes 4 ms (a scheduler's time slice: a thread of the team
# lost its core) stalls the whole step. The peer slice's uniform b=1 rows ran 15-26% slower than
# their trials' median step (thirty-first session) and the worker's longest job since it started
# was 31 ms; these counts, taken per row by bench offload, say whether the two are related.
SLOW_JOBS, STALLED_JOBS = 17, 18
SLOW_JOB_NS, STALL_NS = 1_000_000, 4_000_000
# Pinning the worker (ENV_CPUS, as llama.cpp's --cpu-mask with --cpu-strict): the thread runs on
# cpus[0] and its SpinTeam's thread t on cpus[t % len(cpus)]. Why it is offered: a team that
# spins on cores the scheduler may hand to another runnable thread (CUDA's, Python's, the
# copier) or migrate its threads between loses a time slice now and then, and a decode layer
# waits for the job (the tail above). Off unless set: not yet measured to help on the H200.
# PINNED: the threads whose pinning the kernel took, written once PINS_KNOWN is 1.
PINNED, PINS_KNOWN = 19, 20
ENV_CPUS = "FREETOKEN_WORKER_CPUS"
CTRL = 24
TIMEOUT_S = 2.0  # a device wait's bound: jobs take well under a millisecond
# The worker's kernel threads: "spin" (a team of its own that spins between jobs:
# expert_kernel.cpp SpinTeam) or "omp" (its OpenMP team). On the H200 host (twentieth session,
# `bench worker-teams`, jobs posted as the device posts them) the OpenMP team took 0.71 / 0.98 /
# 1.41 ms for 1 / 2 / 4 experts (13-27 GB/s: it sleeps between jobs, and each job's fork and
# barriers wait on wake-ups) and the SpinTeam 0.16 / 0.30 / 0.50 ms (58-75 GB/s, 65-84% of the
# host's read bandwidth); on the peer slice's uniform rows the worker's B_H online was 9.5-40
# GB/s on OpenMP and 55 on the SpinTeam.
ENV_TEAM = "FREETOKEN_WORKER_TEAM"
TEAMS = ("spin", "omp")
SPIN_NS = 20_000_000  # the worker spins this long after a job before it sleeps (1 ms slices)


@dataclass(slots=True)
class Mailbox:
    ctrl: torch.Tensor  # [CTRL] int64
    rows: torch.Tensor  # [T_max * K] int64
    weights: torch.Tensor  # [T_max * K] fp32
    hidden: torch.Tensor  # [T_max, H]
    out: torch.Tensor  # [T_max, H] fp32
    fill_slots: torch.Tensor  # [T_max * K] int64, -1: none

    @classmethod
    def allocate(cls, max_tokens: int, top_k: int, hidden: int, dtype: torch.dtype,
                 pin: bool) -> Mailbox:  # fmt: skip
        """`pin`: page-locked (a CUDA device's kernels read and write it over the link)."""
        p = max_tokens * top_k

        def empty(*shape: int, dt: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dt, pin_memory=pin)

        return cls(
            empty(CTRL, dt=torch.int64),
            empty(p, dt=torch.int64),
            empty(p, dt=torch.float32),
            empty(max_tokens, hidden, dt=dtype),
            empty(max_tokens, hidden, dt=torch.float32),
            torch.full((p,), -1, dtype=torch.int64, pin_memory=pin),
        )

    @property
    def max_tokens(self) -> int:
        return self.hidden.shape[0]

    @property
    def top_k(self) -> int:
        return self.rows.numel() // self.max_tokens


def available() -> bool:
    """Whether this machine built the SIMD kernel the worker runs (no compiler: torch only)."""
    return experts.backend() != "torch"


class CpuWorker:
    """The thread answering `mailbox` from the pool banks w13 [N, 2I, H], w2 [N, H, I] (host,
    contiguous; they and the mailbox must outlive it: the bank holds all three)."""

    def __init__(self, mailbox: Mailbox, w13: torch.Tensor, w2: torch.Tensor,
                 threads: int | None = None, spin_ns: int = SPIN_NS,
                 team: str | None = None) -> None:  # fmt: skip
        """`team`: "omp" or "spin" (TEAMS); default FREETOKEN_WORKER_TEAM, else "spin"."""
        team = team or os.environ.get(ENV_TEAM, "spin")
        if team not in TEAMS:
            raise ValueError(f"{ENV_TEAM}={team!r}; choose one of {', '.join(TEAMS)}")
        self.team = team
        self.cpus = cpus_from_env()
        if self.cpus and team != "spin":  # OpenMP's threads would inherit the worker's core
            raise ValueError(f"{ENV_CPUS} pins the spin team only; {ENV_TEAM}={team!r}")
        if not available():
            raise RuntimeError("the CPU branch of decode graphs needs the SIMD expert kernel")
        assert w13.is_contiguous() and w2.is_contiguous(), "the pool must be contiguous"
        dt = mailbox.hidden.dtype
        assert w13.dtype == dt, f"pool {w13.dtype}, mailbox {dt}"
        lib = experts.library(experts.backend())
        _declare(lib)
        self.mailbox = mailbox
        self._pool = (w13, w2)  # the thread reads them until it stops
        # The OpenMP team sleeps between jobs and may take every core but the driver's.
        default = experts.spin_team_size() if team == "spin" else experts.default_threads()
        self.threads = threads or default
        k = mailbox.top_k
        handle = lib.ft_worker_start(
            mailbox.ctrl.data_ptr(), mailbox.rows.data_ptr(), mailbox.fill_slots.data_ptr(),
            mailbox.weights.data_ptr(), mailbox.hidden.data_ptr(), mailbox.out.data_ptr(),
            w13.data_ptr(), w2.data_ptr(),
            experts.DTYPE_ID[w13.dtype], w13.shape[0], w13.shape[2], w2.shape[2], k,
            mailbox.max_tokens, self.threads, spin_ns, int(team == "spin"),
            (ctypes.c_int * len(self.cpus))(*self.cpus), len(self.cpus),
        )  # fmt: skip
        if not handle:
            raise RuntimeError("ft_worker_start refused its arguments")
        self._lib, self._handle = lib, handle
        # The copies behind's configuration, shared with the finalizer (which must not hold
        # the worker): its tensors and stream live while the thread may use them.
        self._behind: list[BehindCopies | None] = [None]
        # Stopped when the worker is dropped, whoever forgets to: a spinning thread must not
        # outlive the engine that fed it.
        self._finalizer = weakref.finalize(self, _stop, lib, handle, self._behind)
        if self.cpus and (pinned := self.pinned()) < self.threads:  # runs unpinned, once said
            log.warning("%s=%s: %d of the CPU worker's %d threads could be pinned; the rest "
                        "run where the scheduler puts them", ENV_CPUS,
                        os.environ.get(ENV_CPUS), pinned, self.threads)  # fmt: skip

    def pinned(self, timeout_s: float = 2.0) -> int:
        """The worker's threads pinned to their cores (0 without ENV_CPUS), once it knows
        (its team's threads pin themselves as they start)."""
        end = time.monotonic() + timeout_s
        while int(self.mailbox.ctrl[PINS_KNOWN]) != 1:
            if time.monotonic() > end:
                raise RuntimeError(f"the CPU worker's threads did not start in {timeout_s} s")
            time.sleep(0.001)
        return int(self.mailbox.ctrl[PINNED])

    @property
    def behind(self) -> BehindCopies | None:
        return self._behind[0]

    def set_behind(self, behind: BehindCopies | None, ring: int = RING) -> None:
        """Copies behind into `behind`'s slots after each answer (None: off). Between jobs only;
        the previous configuration's copies land first. `ring`: the jobs the copier may be
        behind before the worker drops copies (fixed by the first configuration). ValueError
        when it does not fit the pool (behind_copies.BehindCopies.check)."""
        if behind is not None:
            behind.check(*self._pool)
        if not self.running:
            raise RuntimeError("set_behind on a stopped worker")
        self.drain_behind()
        slots: list[int | None] = [None, None, 0, 0, 0, None]  # off
        cuda: list[int | None] = [None] * 6  # CPU slots
        if behind is not None:
            w13, w2 = behind.w13, behind.w2
            slots = [w13.data_ptr(), w2.data_ptr(), w13.shape[0], w13.stride(0), w2.stride(0),
                     behind.landed.data_ptr()]  # fmt: skip
        if behind is not None and behind.on_cuda:
            d = behind.driver
            cuda = [behind.landed_src.data_ptr(), d.ctx, behind.stream.cuda_stream,
                    d.set_current, d.htod_async, d.copy2d_async]  # fmt: skip
        rc = self._lib.ft_worker_set_behind(self._handle, *slots, *cuda, ring)
        if rc != 0:
            raise RuntimeError(f"ft_worker_set_behind refused its arguments ({rc})")
        self._behind[0] = behind

    def drain_behind(self, timeout_s: float = 2.0) -> None:
        """Every job posted so far has its copies behind queued (ctrl[BEHIND] reaches the
        POST read now) and landed (the side stream synchronized). No-op while they are off."""
        behind = self._behind[0]
        if behind is None:
            return
        ctrl = self.mailbox.ctrl
        posted, end = int(ctrl[POST]), time.monotonic() + timeout_s
        while self.running and int(ctrl[BEHIND]) != posted:
            if time.monotonic() > end:
                raise RuntimeError(f"copies behind: job {posted} posted, the last queued is job "
                                   f"{int(ctrl[BEHIND])} after {timeout_s} s")  # fmt: skip
            time.sleep(0)
        behind.synchronize()

    def wake(self) -> None:
        """Before a replay that may post: the thread spins from now on (no-op while it spins,
        and once stopped: the handle is freed then, and waking it aborted the process)."""
        if self._finalizer.alive:
            self._lib.ft_worker_wake(ctypes.c_void_p(self._handle))

    def stop(self) -> None:
        """Join the thread (idempotent)."""
        self._finalizer()

    @property
    def running(self) -> bool:
        return self._finalizer.alive


_declared: set[int] = set()


def _declare(lib: ctypes.CDLL) -> None:
    if id(lib) in _declared:
        return
    vp, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.ft_worker_start.restype = vp
    lib.ft_worker_start.argtypes = [vp] * 8 + [ctypes.c_int] + [i64] * 5 + [ctypes.c_int, i64]
    lib.ft_worker_start.argtypes += [ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.c_int]
    lib.ft_worker_set_behind.restype = ctypes.c_int
    lib.ft_worker_set_behind.argtypes = [vp] * 3 + [i64] * 3 + [vp] * 7 + [i64]
    lib.ft_worker_wake.argtypes = [vp]
    lib.ft_worker_wake.restype = None
    lib.ft_worker_stop.argtypes = [vp]
    lib.ft_worker_stop.restype = None
    _declared.add(id(lib))


def _stop(lib: ctypes.CDLL, handle: int, behind: list[BehindCopies | None]) -> None:
    """Join the thread and its copier (which makes the copies queued first), then let the last
    copies behind land: queued on the side stream, they still read the pool and write the
    slots, which may be freed once the worker is gone."""
    lib.ft_worker_stop(ctypes.c_void_p(handle))
    if behind[0] is not None:
        behind[0].synchronize()


def cpus_from_env() -> list[int]:
    """ENV_CPUS as a list of cores ("0-11", "0,2,4-7"; unset or empty: []); ValueError naming
    the problem for a malformed list or a core this process may not run on."""
    value = os.environ.get(ENV_CPUS, "").strip()
    if not value:
        return []
    cpus: list[int] = []
    for part in value.split(","):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        lo, hi = (int(match[1]), int(match[2] or match[1])) if match else (0, -1)
        if hi < lo:
            raise ValueError(f"{ENV_CPUS}={value!r}: {part!r} is not a core or a range lo-hi")
        cpus.extend(range(lo, hi + 1))
    allowed = os.sched_getaffinity(0)
    outside = sorted(set(cpus) - allowed)
    if outside:
        raise ValueError(f"{ENV_CPUS}={value!r}: cores {outside} are not among this process's "
                         f"{sorted(allowed)}")  # fmt: skip
    return cpus
