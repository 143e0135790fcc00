"""The CPU worker thread (`kernels/cpu/worker.py`, `expert_worker.cpp`): this test plays the
device's side of the mailbox protocol from Python and checks every answer against the kernel
called directly. T tokens, K top-k, H hidden, I expert width, N pool rows."""

from __future__ import annotations

import random
import time

import pytest
import torch

from freetoken_agent.kernels.cpu import experts, worker
from freetoken_agent.kernels.cpu.worker import (
    ANSWER,
    BUSY_NS,
    COL_HI,
    COL_LO,
    COLUMNS,
    ERROR,
    EXPERTS,
    JOBS,
    POST,
    TOKENS,
)

H, W, N, K, T_MAX = 64, 24, 12, 4, 3  # W: the expert width I

pytestmark = pytest.mark.skipif(not worker.available(), reason="no SIMD expert kernel here")


def post(box: worker.Mailbox, seq: int, hidden, rows, weights) -> None:
    """The device's post: the job's data, then the sequence number."""
    t = hidden.shape[0]
    box.hidden[:t].copy_(hidden)
    box.rows[: rows.numel()].copy_(rows.reshape(-1))
    box.weights[: weights.numel()].copy_(weights.reshape(-1))
    box.ctrl[TOKENS] = t
    box.ctrl[POST] = seq


def wait(box: worker.Mailbox, seq: int, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while int(box.ctrl[ANSWER]) != seq:
        assert time.monotonic() < end, f"no answer to job {seq}"
        time.sleep(0)


def job(gen: torch.Generator, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    hidden = torch.randn(t, H, generator=gen).to(torch.bfloat16)
    rows = torch.randint(-1, N, (t, K), generator=gen)  # -1: a pair the device computes
    weights = torch.rand(t, K, generator=gen)
    return hidden, rows, weights


def _pool_and_box(gen: torch.Generator):
    """A random bf16 pool (w13 [N, 2W, H], w2 [N, H, W]) and a mailbox: (w13, w2, box)."""
    w13 = torch.randn(N, 2 * W, H, generator=gen).to(torch.bfloat16)
    w2 = torch.randn(N, H, W, generator=gen).to(torch.bfloat16)
    return w13, w2, worker.Mailbox.allocate(T_MAX, K, H, torch.bfloat16, pin=False)


def _started(gen: torch.Generator, team: str, threads: int = 2):
    """`_pool_and_box` and a worker of `team` answering it (`threads` threads, 1 ms of spin):
    (w13, w2, box, worker)."""
    w13, w2, box = _pool_and_box(gen)
    cpu = worker.CpuWorker(box, w13, w2, threads=threads, spin_ns=1_000_000, team=team)
    return w13, w2, box, cpu


def _answers_a_job(gen: torch.Generator, w13, w2, box: worker.Mailbox) -> None:
    """One job of T_MAX tokens posted and answered as the kernel computes it."""
    hidden, rows, weights = job(gen, T_MAX)
    post(box, 1, hidden, rows, weights)
    wait(box, 1)
    assert torch.equal(box.out[:T_MAX], experts.cpu_experts(hidden, w13, w2, rows, weights))


@pytest.mark.parametrize("team", worker.TEAMS)
def test_worker_answers_each_post_as_the_kernel_computes_it(team):
    """Its kernel threads either way: its OpenMP team, or a SpinTeam of its own (the same
    bits: both split the work by thread alike)."""
    gen = torch.Generator().manual_seed(random.randrange(1 << 30))
    w13, w2, box, cpu = _started(gen, team)
    try:
        distinct = 0
        for seq in range(1, 9):
            if seq == 5:
                time.sleep(0.01)  # past the spin: the thread sleeps and must still answer
            t = int(torch.randint(1, T_MAX + 1, (1,), generator=gen))
            hidden, rows, weights = job(gen, t)
            post(box, seq, hidden, rows, weights)
            if seq % 2:
                cpu.wake()  # a wake while it spins changes nothing
            wait(box, seq)
            want = experts.cpu_experts(hidden, w13, w2, rows, weights)
            assert torch.equal(box.out[:t], want), f"job {seq} differs"
            distinct += len(set(rows[rows >= 0].tolist()))
        assert int(box.ctrl[JOBS]) == 8
        assert int(box.ctrl[EXPERTS]) == distinct
        assert int(box.ctrl[BUSY_NS]) > 0
        assert int(box.ctrl[ERROR]) == 0
    finally:
        cpu.stop()
    assert not cpu.running
    cpu.stop()  # idempotent


@pytest.mark.parametrize("team", worker.TEAMS)
def test_default_threads_per_team(team, monkeypatch):
    """The SpinTeam is sized by spin_team_size, the OpenMP team by default_threads."""
    monkeypatch.setattr(worker.experts, "spin_team_size", lambda: 3)
    monkeypatch.setattr(worker.experts, "default_threads", lambda: 2)
    w13 = torch.randn(N, 2 * W, H).to(torch.bfloat16)
    w2 = torch.randn(N, H, W).to(torch.bfloat16)
    box = worker.Mailbox.allocate(T_MAX, K, H, torch.bfloat16, pin=False)
    cpu = worker.CpuWorker(box, w13, w2, spin_ns=1_000_000, team=team)
    try:
        assert cpu.threads == (3 if team == "spin" else 2)
    finally:
        cpu.stop()


@pytest.mark.parametrize("team", worker.TEAMS)
def test_waking_a_stopped_worker_never_reaches_its_freed_handle(team):
    """The engine wakes its worker before every replay that may post, also after the worker
    was stopped (a failing share stops it mid-run): its handle is freed by then, and waking it
    aborted the process (seen on the dev box). A live worker's wake reaches the library."""
    from types import SimpleNamespace

    w13 = torch.randn(N, 2 * W, H).to(torch.bfloat16)
    w2 = torch.randn(N, H, W).to(torch.bfloat16)
    box = worker.Mailbox.allocate(T_MAX, K, H, torch.bfloat16, pin=False)
    cpu = worker.CpuWorker(box, w13, w2, threads=2, team=team)
    lib, woken = cpu._lib, []
    cpu._lib = SimpleNamespace(ft_worker_wake=lambda handle: woken.append(handle.value))
    cpu.wake()
    assert woken == [cpu._handle]
    cpu._lib = lib
    cpu.stop()
    cpu._lib = SimpleNamespace(ft_worker_wake=lambda handle: woken.append(handle.value))
    for _ in range(3):
        cpu.wake()
    assert woken == [cpu._handle] and not cpu.running


def test_a_bad_team_is_refused(monkeypatch):
    box = worker.Mailbox.allocate(T_MAX, K, H, torch.bfloat16, pin=False)
    pool = (
        torch.zeros(N, 2 * W, H, dtype=torch.bfloat16),
        torch.zeros(N, H, W, dtype=torch.bfloat16),
    )
    monkeypatch.setenv(worker.ENV_TEAM, "tbb")
    with pytest.raises(ValueError, match="FREETOKEN_WORKER_TEAM='tbb'"):
        worker.CpuWorker(box, *pool)


def test_worker_reports_a_job_it_cannot_run_and_keeps_answering():
    gen = torch.Generator().manual_seed(random.randrange(1 << 30))
    w13 = torch.randn(N, 2 * W, H, generator=gen).to(torch.bfloat16)
    w2 = torch.randn(N, H, W, generator=gen).to(torch.bfloat16)
    box = worker.Mailbox.allocate(T_MAX, K, H, torch.bfloat16, pin=False)
    cpu = worker.CpuWorker(box, w13, w2, threads=1)
    try:
        hidden, rows, weights = job(gen, 1)
        rows[0, 0] = N + 3  # past the pool
        post(box, 1, hidden, rows, weights)
        wait(box, 1)
        assert int(box.ctrl[ERROR]) == -1  # ft_cpu_experts: a row out of range
        box.ctrl[ERROR] = 0
        box.ctrl[TOKENS] = T_MAX + 1  # more tokens than the mailbox holds
        box.ctrl[POST] = 2
        wait(box, 2)
        assert int(box.ctrl[ERROR]) == -3
        box.ctrl[ERROR] = 0
        hidden, rows, weights = job(gen, 2)
        post(box, 3, hidden, rows, weights)
        wait(box, 3)
        assert torch.equal(box.out[:2], experts.cpu_experts(hidden, w13, w2, rows, weights))
        assert int(box.ctrl[ERROR]) == 0
    finally:
        cpu.stop()


@pytest.mark.parametrize("team", worker.TEAMS)
def test_a_job_with_a_column_range_computes_that_slice(team, rng_seed):
    """The split expert's CPU half through the mailbox: COL_LO / COL_HI posted with the job;
    COL_HI 0 is the whole width. COLUMNS counts distinct experts x columns (B_H's bytes)."""
    rng = random.Random(rng_seed)
    gen = torch.Generator().manual_seed(rng_seed)
    w13, w2, box, cpu = _started(gen, team)
    try:
        columns = 0
        for seq in range(1, 7):
            t = rng.randint(1, T_MAX)
            hidden, rows, weights = job(gen, t)
            c0 = rng.randrange(W)
            c1 = rng.randint(c0 + 1, W)
            whole = seq % 3 == 0
            box.ctrl[COL_LO], box.ctrl[COL_HI] = (0, 0) if whole else (c0, c1)
            post(box, seq, hidden, rows, weights)
            wait(box, seq)
            cut = None if whole else (c0, c1)
            want = experts.cpu_experts(hidden, w13, w2, rows, weights, columns=cut)
            assert torch.equal(box.out[:t], want), (seq, cut)
            columns += len(set(rows[rows >= 0].tolist())) * (W if whole else c1 - c0)
        assert int(box.ctrl[COLUMNS]) == columns and int(box.ctrl[ERROR]) == 0
    finally:
        cpu.stop()


def test_the_jobs_tail_counts_each_job_past_one_and_four_ms(rng_seed):
    """SLOW_JOBS / STALLED_JOBS count the jobs whose time (each job's BUSY_NS) passed 1 and
    4 ms. Jobs of one expert, of all 24 experts of the 30B shape (226 MB of pool on two
    threads: past 4 ms on any host we run on; the first job, which times an expert), and of
    as many experts as should take ~2.5 ms here, in a random order."""
    rng = random.Random(rng_seed)
    gen = torch.Generator().manual_seed(rng_seed)
    h, w, n, k, t_max = 2048, 768, 24, 8, 3
    w13 = torch.randn(n, 2 * w, h, generator=gen).to(torch.bfloat16)
    w2 = torch.randn(n, h, w, generator=gen).to(torch.bfloat16)
    box = worker.Mailbox.allocate(t_max, k, h, torch.bfloat16, pin=False)
    cpu = worker.CpuWorker(box, w13, w2, threads=2, spin_ns=1_000_000)
    size = n  # experts in the next job; drawn once the first job has timed an expert
    slow = stalled = 0
    try:
        for seq in range(1, 9):
            lids = torch.randperm(n, generator=gen)[:size]
            rows = torch.full((t_max * k,), -1, dtype=torch.long)
            rows[: lids.numel()] = lids
            hidden = torch.randn(t_max, h, generator=gen).to(torch.bfloat16)
            busy = int(box.ctrl[BUSY_NS])
            post(box, seq, hidden, rows.view(t_max, k), torch.rand(t_max, k, generator=gen))
            wait(box, seq, timeout=60.0)
            took = int(box.ctrl[BUSY_NS]) - busy
            slow += took > worker.SLOW_JOB_NS
            stalled += took > worker.STALL_NS
            assert int(box.ctrl[worker.SLOW_JOBS]) == slow, f"job {seq} took {took} ns"
            assert int(box.ctrl[worker.STALLED_JOBS]) == stalled, f"job {seq} took {took} ns"
            if seq == 1:
                medium = max(1, min(n, round(2_500_000 * n / took)))
            size = rng.choice([1, medium, n])
        assert stalled >= 1  # the whole-pool job reached the stall counter
        assert int(box.ctrl[ERROR]) == 0
    finally:
        cpu.stop()


def _tasks() -> set[int]:
    import os

    return {int(t) for t in os.listdir("/proc/self/task")}


def _allowed_cores(tid: int) -> set[int]:
    """The cores /proc says thread `tid` may run on."""
    with open(f"/proc/self/task/{tid}/status") as f:
        line = next(row for row in f if row.startswith("Cpus_allowed_list:"))
    cores: set[int] = set()
    for part in line.split(":", 1)[1].strip().split(","):
        lo, _, hi = part.partition("-")
        cores.update(range(int(lo), int(hi or lo) + 1))
    return cores


@pytest.mark.parametrize("pin", [False, True])
def test_the_worker_pins_its_threads_to_the_cores_asked(pin, monkeypatch):
    """FREETOKEN_WORKER_CPUS: the worker's thread on the list's first core and its SpinTeam's
    thread t on core t % n, each allowed that core only (read back from /proc); unset, they
    keep the process's cores. The answers are the kernel's either way."""
    import os

    allowed = sorted(os.sched_getaffinity(0))
    n = random.randint(min(2, len(allowed)), min(3, len(allowed)))  # distinct where it can
    cores = random.sample(allowed, n)
    threads = random.randint(max(2, n), 4)
    if pin:
        monkeypatch.setenv(worker.ENV_CPUS, ",".join(map(str, cores)))
    else:
        monkeypatch.delenv(worker.ENV_CPUS, raising=False)
    gen = torch.Generator().manual_seed(random.randrange(1 << 30))
    w13, w2, box = _pool_and_box(gen)  # (torch may start its own threads here)
    before = _tasks()
    cpu = worker.CpuWorker(box, w13, w2, threads=threads, spin_ns=1_000_000, team="spin")
    try:
        assert cpu.pinned() == (threads if pin else 0)
        new = _tasks() - before
        assert len(new) == threads  # the worker's thread and its team's threads - 1
        masks = sorted(sorted(_allowed_cores(tid)) for tid in new)
        want = [[cores[t % len(cores)]] for t in range(threads)] if pin else [allowed] * threads
        assert masks == sorted(want)
        _answers_a_job(gen, w13, w2, box)
    finally:
        cpu.stop()


@pytest.mark.parametrize(
    "value, problem",
    [("0-", "not a core"), ("a", "not a core"), ("3-1", "not a core"), ("4096", "not among")],
)
def test_a_bad_core_list_is_refused_by_name(value, problem, monkeypatch):
    monkeypatch.setenv(worker.ENV_CPUS, value)
    box = worker.Mailbox.allocate(T_MAX, K, H, torch.bfloat16, pin=False)
    w13, w2 = (
        torch.zeros(N, 2 * W, H, dtype=torch.bfloat16),
        torch.zeros(N, H, W, dtype=torch.bfloat16),
    )
    with pytest.raises(ValueError, match=f"{worker.ENV_CPUS}.*{problem}"):
        worker.CpuWorker(box, w13, w2, threads=2, team="spin")
    monkeypatch.setenv(worker.ENV_CPUS, "0")
    with pytest.raises(ValueError, match="spin team only"):
        worker.CpuWorker(box, w13, w2, threads=2, team="omp")


def test_a_core_the_kernel_refuses_leaves_its_threads_unpinned_with_a_warning(monkeypatch, caplog):
    """A core that passes the list's check but that the kernel refuses (offline, taken away
    since): the worker still runs and answers, and says once how many threads it pinned."""
    monkeypatch.setattr(worker, "cpus_from_env", lambda: [1000 + random.randrange(3000)])
    monkeypatch.setenv(worker.ENV_CPUS, "(patched)")
    gen = torch.Generator().manual_seed(random.randrange(1 << 30))
    threads = random.randint(2, 3)
    with caplog.at_level("WARNING", logger="freetoken.experts"):
        w13, w2, box, cpu = _started(gen, "spin", threads)
    try:
        assert cpu.pinned() == 0
        warnings = [r.getMessage() for r in caplog.records if worker.ENV_CPUS in r.getMessage()]
        assert len(warnings) == 1 and f"0 of the CPU worker's {threads} threads" in warnings[0]
        _answers_a_job(gen, w13, w2, box)
    finally:
        cpu.stop()
