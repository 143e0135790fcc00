"""The CPU worker's copies behind (the split expert; kernels/cpu/behind_copies.py,
expert_worker.cpp, behind_copier.cpp): after answering a job, the worker hands it to its copier
thread, which copies the job's columns of each named pool row into its cache slot and marks
landed[slot]. This test plays the device's side of the mailbox from Python and checks every
slot bank element. T tokens, K top-k, H hidden, W expert width I, N pool rows, S slots."""

from __future__ import annotations

import ctypes
import os
import random
import threading
import time
from pathlib import Path

import pytest
import torch

from freetoken_agent.kernels.cpu import experts, worker
from freetoken_agent.kernels.cpu.behind_copies import BehindCopies
from freetoken_agent.kernels.cpu.worker import (
    ANSWER,
    BEHIND,
    BEHIND_ERROR,
    BEHIND_EXPERTS,
    COL_HI,
    COL_LO,
    ERROR,
    POST,
    TOKENS,
)

H, W, N, K, T_MAX, S = 64, 24, 12, 4, 3, 6

pytestmark = pytest.mark.skipif(not worker.available(), reason="no SIMD expert kernel here")


class Slots:
    """Random slot banks w13 [S, 2W, H], w2 [S, H, W] and landed [S] on `device`, each slot
    followed by padding (a slot stride past the slot's size); `base*` hold the padding too."""

    def __init__(self, gen: torch.Generator, device: str = "cpu") -> None:
        self.base13 = torch.randn(S, 2 * W + 1, H, generator=gen).to(torch.bfloat16).to(device)
        self.base2 = torch.randn(S, H * W + 5, generator=gen).to(torch.bfloat16).to(device)
        self.w13 = self.base13[:, : 2 * W]  # [S, 2W, H]
        self.w2 = self.base2[:, : H * W].view(S, H, W)  # [S, H, W]
        self.landed = torch.randint(100, 200, (S,), generator=gen).to(device)  # no lid: < N

    def snapshot(self) -> tuple[torch.Tensor, ...]:
        return tuple(t.cpu().clone() for t in (self.base13, self.base2, self.landed))

    def behind(self) -> BehindCopies:
        return BehindCopies.to_slots(self.w13, self.w2, self.landed)


def expect(before, w13, w2, fills: dict[int, int], c0: int, c1: int):
    """The banks (with padding) and landed after copying columns [c0, c1) of `fills`
    {slot: lid} into `before`'s slots."""
    base13, base2, landed = (t.clone() for t in before)
    for slot, lid in fills.items():
        base13[slot, c0:c1] = w13[lid, c0:c1]
        base13[slot, W + c0 : W + c1] = w13[lid, W + c0 : W + c1]
        base2[slot, : H * W].view(H, W)[:, c0:c1] = w2[lid, :, c0:c1]
        landed[slot] = lid
    return base13, base2, landed


def post(box: worker.Mailbox, seq: int, hidden, rows, weights, fill_slots, cols) -> None:
    """The device's post: the job's data and columns, then the sequence number."""
    t = hidden.shape[0]
    box.hidden[:t].copy_(hidden)
    box.rows[: rows.numel()].copy_(rows.reshape(-1))
    box.weights[: weights.numel()].copy_(weights.reshape(-1))
    box.fill_slots.fill_(-1)
    box.fill_slots[: fill_slots.numel()].copy_(fill_slots.reshape(-1))
    box.ctrl[COL_LO], box.ctrl[COL_HI] = cols
    box.ctrl[TOKENS] = t
    box.ctrl[POST] = seq


def wait(box: worker.Mailbox, seq: int, timeout: float = 10.0, entry: int = ANSWER) -> None:
    """Until ctrl[entry] (ANSWER or BEHIND) holds seq."""
    end = time.monotonic() + timeout
    while int(box.ctrl[entry]) != seq:
        assert time.monotonic() < end, f"no ctrl[{entry}] for job {seq}"
        time.sleep(0)


def split_job(gen: torch.Generator, rng: random.Random, slots: list[int]):
    """A T_MAX-token job whose CPU pairs name fill slots. Pair 0 and pair 1 pick two lids a != b
    (pair 1's lid again at pair [1, 2], which names the same slot); each lid's first pair takes
    the next of `slots` but the last, its later pairs name that slot or -1 at random; pair [2, 3]
    is -1 (the device's) and names the last slot: nothing lands there. Returns hidden, rows,
    weights, fill_slots [T, K] and the copies due {slot: lid}."""
    hidden = torch.randn(T_MAX, H, generator=gen).to(torch.bfloat16)
    rows = torch.randint(-1, N, (T_MAX, K), generator=gen)
    a, b = rng.sample(range(N), 2)
    rows[0, 0], rows[0, 1], rows[1, 2], rows[2, 3] = a, b, b, -1
    weights = torch.rand(T_MAX, K, generator=gen)
    fill_slots = torch.full((T_MAX * K,), -1, dtype=torch.int64)
    slot_of: dict[int, int] = {}
    free = list(slots[:-1])
    for p, lid in enumerate(rows.reshape(-1).tolist()):
        if lid < 0:
            continue
        if lid in slot_of:
            if p == 1 * K + 2 or rng.random() < 0.5:
                fill_slots[p] = slot_of[lid]
        elif free:
            slot_of[lid] = fill_slots[p] = free.pop(0)
    fill_slots[2 * K + 3] = slots[-1]
    return hidden, rows, weights, fill_slots.view(T_MAX, K), {s: lid for lid, s in slot_of.items()}


def started(gen: torch.Generator, pin: bool = False):
    w13 = torch.randn(N, 2 * W, H, generator=gen).to(torch.bfloat16)
    w2 = torch.randn(N, H, W, generator=gen).to(torch.bfloat16)
    if pin:
        w13, w2 = w13.pin_memory(), w2.pin_memory()
    box = worker.Mailbox.allocate(T_MAX, K, H, torch.bfloat16, pin=pin)
    return w13, w2, box, worker.CpuWorker(box, w13, w2, threads=2, spin_ns=1_000_000)


def run_split_jobs(gen, rng, device: str) -> None:
    """Two jobs with fills: a column job (COL_LO c0, COL_HI W) into some slots, then whole
    experts (COL_LO = COL_HI = 0) into the others; every bank element checked after each."""
    w13, w2, box, cpu = started(gen, pin=device == "cuda")
    slots = Slots(gen, device)
    try:
        assert (box.fill_slots == -1).all() and box.fill_slots.shape == (T_MAX * K,)
        cpu.set_behind(slots.behind())
        order = rng.sample(range(S), S)
        copied = 0
        for seq, (cols, chosen) in enumerate(
            [((rng.randrange(1, W), W), order[:3]), ((0, 0), order[3:])], start=1
        ):
            before = slots.snapshot()
            hidden, rows, weights, fill_slots, fills = split_job(gen, rng, chosen)
            post(box, seq, hidden, rows, weights, fill_slots, cols)
            wait(box, seq)
            cpu.drain_behind()
            c0, c1 = cols[0], cols[1] or W
            want = experts.cpu_experts(hidden, w13, w2, rows, weights, columns=(c0, c1))
            assert torch.equal(box.out[:T_MAX], want), f"job {seq}"
            got = slots.snapshot()
            for name, x, y in zip(("w13", "w2", "landed"), got, expect(before, w13, w2, fills,
                                  c0, c1), strict=True):  # fmt: skip
                assert torch.equal(x, y), f"job {seq}: slot bank {name}, fills {fills}"
            copied += len(fills)
            assert int(box.ctrl[BEHIND]) == seq
            assert int(box.ctrl[BEHIND_EXPERTS]) == copied
            assert int(box.ctrl[ERROR]) == 0
    finally:
        cpu.stop()


def test_cpu_slots_take_the_jobs_columns_behind_the_answer(rng_seed):
    rng = random.Random(rng_seed)
    run_split_jobs(torch.Generator().manual_seed(rng_seed), rng, "cpu")


@pytest.mark.gpu
def test_cuda_slots_take_the_jobs_columns_behind_the_answer(rng_seed):
    """The driver-API copies on a side stream: pinned pool and mailbox, slots on the GPU."""
    rng = random.Random(rng_seed)
    run_split_jobs(torch.Generator().manual_seed(rng_seed), rng, "cuda")


def test_copies_behind_off_copy_nothing_and_leave_behind_alone(rng_seed):
    """Never configured, then on for one job, then off: only the job while on copies, BEHIND
    moves only then (turning on marks the jobs before as done: a drain never waits for them)."""
    rng = random.Random(rng_seed)
    gen = torch.Generator().manual_seed(rng_seed)
    w13, w2, box, cpu = started(gen)
    slots = Slots(gen)
    try:
        cpu.drain_behind()  # off: returns at once
        states = []
        for seq in (1, 2, 3):
            if seq == 2:
                cpu.set_behind(slots.behind())
                assert int(box.ctrl[BEHIND]) == 1
            if seq == 3:
                cpu.set_behind(None)
            before = slots.snapshot()
            hidden, rows, weights, fill_slots, fills = split_job(gen, rng, rng.sample(range(S), 3))
            post(box, seq, hidden, rows, weights, fill_slots, (0, 0))
            wait(box, seq)
            cpu.drain_behind()
            time.sleep(0.01)  # a copy made after the answer would land by now
            changed = [not torch.equal(x, y) for x, y in zip(before, slots.snapshot(), strict=True)]
            states.append((changed, int(box.ctrl[BEHIND]), int(box.ctrl[BEHIND_EXPERTS])))
            if seq == 2:
                want = expect(before, w13, w2, fills, 0, W)
                assert all(torch.equal(x, y) for x, y in zip(slots.snapshot(), want, strict=True))
        assert states[0] == ([False] * 3, 0, 0)
        assert states[1][0] == [True] * 3 and states[1][1] == 2
        assert states[2] == ([False] * 3, 2, states[1][2]) and states[1][2] > 0
        assert cpu.behind is None
    finally:
        cpu.stop()


def test_a_bad_configuration_is_refused_by_name():
    gen = torch.Generator().manual_seed(0)
    _, _, _, cpu = started(gen)
    s = Slots(gen)
    try:
        wide = torch.zeros(S, H, W + 1, dtype=torch.bfloat16)  # I of W + 1
        strided = s.w13.transpose(1, 2).contiguous().transpose(1, 2)  # [S, 2W, H], H-major
        meta = (t.to("meta") for t in (s.w13, s.w2, s.landed))
        bad = {
            "slot bank w2": BehindCopies(s.w13, wide, s.landed),
            "slot bank w13 .* the pool": BehindCopies(s.w13.half(), s.w2, s.landed),
            "landed must be .* got .6,. torch.int32": BehindCopies(s.w13, s.w2, s.landed.int()),
            "landed must be a contiguous .S=6.": BehindCopies(s.w13, s.w2, s.landed[:-1]),
            "each slot must be contiguous": BehindCopies(strided, s.w2, s.landed),
            "one CPU or CUDA device": BehindCopies(*meta),
        }
        for match, behind in bad.items():
            with pytest.raises(ValueError, match=match):
                cpu.set_behind(behind)
            assert cpu.behind is None
    finally:
        cpu.stop()
    with pytest.raises(RuntimeError, match="stopped"):
        cpu.set_behind(s.behind())


def test_bad_fills_are_reported_and_the_worker_keeps_answering(rng_seed):
    """A fill slot past the bank (-5) copies nothing for its pair; one slot named for two rows
    (-6) takes the first pair's; a failed job (-1, a row past the pool) copies nothing. BEHIND is
    stored for each (a drain never hangs) and the next job's copies go as usual."""
    rng = random.Random(rng_seed)
    gen = torch.Generator().manual_seed(rng_seed)
    w13, w2, box, cpu = started(gen)
    slots = Slots(gen)
    cpu.set_behind(slots.behind())
    try:
        for seq, case in enumerate(("past the bank", "twice", "failed", "fine"), start=1):
            before = slots.snapshot()
            hidden, rows, weights, fill_slots, fills = split_job(gen, rng, [0, 1, 2, 3])
            code = 0
            if case == "past the bank":
                s0 = int(fill_slots[0, 0])
                fill_slots[fill_slots == s0] = S  # the first slot past the bank
                fills.pop(s0)
                code = -5
            elif case == "twice":
                s0, s1 = int(fill_slots[0, 0]), int(fill_slots[0, 1])  # lids a, b
                fill_slots[fill_slots == s1] = -1
                fill_slots[0, 1] = s0  # b's first pair names a's slot: a's is copied
                fills.pop(s1)
                code = -6
            elif case == "failed":
                rows[0, 0] = N + 2
                fills, code = {}, -1
            c0 = rng.randrange(W)
            post(box, seq, hidden, rows, weights, fill_slots, (c0, W))
            wait(box, seq)
            cpu.drain_behind()
            # the answer's failure in ERROR, a copy behind's in BEHIND_ERROR
            want_error, want_behind = (code, 0) if case == "failed" else (0, code)
            assert int(box.ctrl[ERROR]) == want_error, case
            assert int(box.ctrl[BEHIND_ERROR]) == want_behind, case
            assert int(box.ctrl[BEHIND]) == seq, case
            for x, y in zip(slots.snapshot(), expect(before, w13, w2, fills, c0, W), strict=True):
                assert torch.equal(x, y), (case, fills)
            if case != "failed":
                want = experts.cpu_experts(hidden, w13, w2, rows, weights, columns=(c0, W))
                assert torch.equal(box.out[:T_MAX], want), case
            box.ctrl[ERROR] = box.ctrl[BEHIND_ERROR] = 0
    finally:
        cpu.stop()


def _end(side: str) -> list[tuple[str, type]]:
    """One end (src or dst) of cuda.h's CUDA_MEMCPY2D_v2."""
    size, vp = ctypes.c_size_t, ctypes.c_void_p
    kinds = (size, size, ctypes.c_int, vp, ctypes.c_uint64, vp, size)
    names = ("XInBytes", "Y", "MemoryType", "Host", "Device", "Array", "Pitch")
    return [(side + n, k) for n, k in zip(names, kinds, strict=True)]


class Memcpy2D(ctypes.Structure):
    """cuda.h's CUDA_MEMCPY2D_v2, as the driver reads it."""

    _fields_ = [*_end("src"), *_end("dst"), ("WidthInBytes", ctypes.c_size_t),
                ("Height", ctypes.c_size_t)]  # fmt: skip


class FakeDriver:
    """libcuda's three entry points played on host memory ("device" addresses are host ones),
    each call recorded; the call numbered `fail_at` returns `code` and copies nothing."""

    CTX, STREAM = 0x1234, 0x5678

    def __init__(self, fail_at: int = -1, code: int = 0, hold: threading.Event | None = None,
                 watch: torch.Tensor | None = None):  # fmt: skip
        """`hold`: set_current waits for it (a copy behind that takes long). `watch`: a
        mailbox's ctrl, whose BEHIND each call records in `seen` (BEHIND during the copies)."""
        self.calls: list[tuple] = []
        self.seen: list[int] = []
        self.fail_at, self.code, self.hold, self.watch = fail_at, code, hold, watch
        vp, size = ctypes.c_void_p, ctypes.c_size_t
        fn = ctypes.CFUNCTYPE
        self._fns = (  # kept: the copier thread calls them
            fn(ctypes.c_int, vp)(self.set_current),
            fn(ctypes.c_int, ctypes.c_uint64, vp, size, vp)(self.htod),
            fn(ctypes.c_int, ctypes.POINTER(Memcpy2D), vp)(self.copy2d),
        )

    def addresses(self) -> list[int]:
        return [ctypes.cast(f, ctypes.c_void_p).value for f in self._fns]

    def _record(self, *call) -> bool:
        self.calls.append(call)
        if self.watch is not None:
            self.seen.append(int(self.watch[BEHIND]))
        return len(self.calls) - 1 == self.fail_at

    def set_current(self, ctx):
        if self.hold is not None:
            self.hold.wait(10)
        return self.code if self._record("ctx", ctx) else 0

    def configure(self, cpu: worker.CpuWorker, slots: Slots, staged: torch.Tensor,
                  ring: int = worker.RING) -> None:  # fmt: skip
        """The worker's CUDA branch aimed at host `slots` through this driver; drain_behind
        sees them as CPU slots (no stream to synchronize)."""
        rc = cpu._lib.ft_worker_set_behind(
            cpu._handle, slots.w13.data_ptr(), slots.w2.data_ptr(), S, slots.w13.stride(0),
            slots.w2.stride(0), slots.landed.data_ptr(), staged.data_ptr(), self.CTX, self.STREAM,
            *self.addresses(), ring,
        )  # fmt: skip
        assert rc == 0
        self.staged = staged  # the copier writes the marks there: it lives as long as this
        cpu._behind[0] = BehindCopies(slots.w13, slots.w2, slots.landed)

    def htod(self, dst, src, n, stream):
        if self._record("htod", dst, src, n, stream):
            return self.code
        ctypes.memmove(dst, src, n)
        return 0

    def copy2d(self, p, stream):
        c = p.contents
        assert (c.srcMemoryType, c.dstMemoryType) == (1, 2), "host to device"
        if self._record("2d", c.srcHost, c.dstDevice, c.WidthInBytes, c.Height, c.srcPitch,
                        c.dstPitch, stream):  # fmt: skip
            return self.code
        for y in range(c.Height):
            dst = c.dstDevice + c.dstXInBytes + (c.dstY + y) * c.dstPitch
            ctypes.memmove(dst, c.srcHost + c.srcXInBytes + (c.srcY + y) * c.srcPitch,
                           c.WidthInBytes)  # fmt: skip
        return 0


def held_driver(rng_seed: int, ring: int | None = None):
    """A started worker whose copies behind go to host slots through a FakeDriver that holds
    every call until `hold` is set (and records BEHIND at each); `ring`: the copier's ring, set
    by a first configuration. Returns rng, gen, w13, w2, box, cpu, slots, hold, fake."""
    rng = random.Random(rng_seed)
    gen = torch.Generator().manual_seed(rng_seed)
    w13, w2, box, cpu = started(gen)
    slots = Slots(gen)
    hold = threading.Event()
    fake, staged = FakeDriver(hold=hold, watch=box.ctrl), torch.full((S,), -1, dtype=torch.int64)
    if ring is not None:
        cpu.set_behind(slots.behind(), ring=ring)
    fake.configure(cpu, slots, staged)
    return rng, gen, w13, w2, box, cpu, slots, hold, fake


def test_the_cuda_copies_call_the_driver_as_documented(rng_seed):
    """The CUDA branch's calls without a GPU (libcuda played on host memory): the context made
    current once, then per slot gate rows, up rows, w2's columns (a 2D copy) and the mark
    staged in landed_src, all on the side stream; a failing call's CUresult r becomes
    BEHIND_ERROR -100 - r (ERROR stays 0: the answer was right), the job's copies stop there,
    and BEHIND is still stored."""
    assert ctypes.sizeof(Memcpy2D) == 128
    rng = random.Random(rng_seed)
    gen = torch.Generator().manual_seed(rng_seed)
    w13, w2, box, cpu = started(gen)
    slots = Slots(gen)
    staged = torch.full((S,), -1, dtype=torch.int64)
    copied = 0
    try:
        failing = FakeDriver(fail_at=2, code=700)
        for seq, fake in ((1, FakeDriver()), (2, failing), (3, failing)):
            if seq < 3:  # job 3: the same configuration, its context already current
                fake.configure(cpu, slots, staged)
            before, made = slots.snapshot(), len(fake.calls)
            box.ctrl[BEHIND_ERROR] = 0
            hidden, rows, weights, fill_slots, fills = split_job(gen, rng, rng.sample(range(S), 4))
            c0 = rng.randrange(W)
            post(box, seq, hidden, rows, weights, fill_slots, (c0, W))
            wait(box, seq)
            wait(box, seq, entry=BEHIND)
            e = 2  # bf16
            want = [("ctx", fake.CTX)]
            for slot, lid in fills.items():  # in pair order, as the worker meets them
                d13 = slots.w13[slot].data_ptr()
                s13 = w13[lid].data_ptr()
                for r in (c0, W + c0):
                    want.append(("htod", d13 + r * H * e, s13 + r * H * e, (W - c0) * H * e))
                want.append(("2d", w2[lid].data_ptr() + c0 * e, slots.w2[slot].data_ptr() + c0 * e,
                             (W - c0) * e, H, W * e, W * e))  # fmt: skip
                want.append(("htod", slots.landed[slot:].data_ptr(), staged[slot:].data_ptr(), 8))
            want = [(*c, fake.STREAM) if c[0] != "ctx" else c for c in want]
            if seq == 3:
                want = want[1:]
            if seq != 2:
                assert fake.calls[made:] == want
                assert [int(staged[s]) for s in fills] == list(fills.values())
                for x, y in zip(slots.snapshot(), expect(before, w13, w2, fills, c0, W),
                                strict=True):  # fmt: skip
                    assert torch.equal(x, y)
                assert int(box.ctrl[BEHIND_ERROR]) == 0
                copied += len(fills)
                assert int(box.ctrl[BEHIND_EXPERTS]) == copied
            else:
                assert fake.calls == want[:3]  # stopped at the failing call
                assert torch.equal(slots.landed, before[2])  # no mark went
                assert int(box.ctrl[BEHIND_ERROR]) == -800 and int(box.ctrl[ERROR]) == 0
                assert int(box.ctrl[BEHIND_EXPERTS]) == copied  # no slot queued whole
    finally:
        cpu.stop()


def test_the_answer_goes_first_and_a_drain_waits_for_the_copies(rng_seed):
    """A copy behind that takes long (the driver held) neither delays the answer nor escapes
    drain_behind: it raises naming the jobs, and returns once the copies are queued."""
    rng, gen, w13, w2, box, cpu, slots, hold, fake = held_driver(rng_seed)
    try:
        hidden, rows, weights, fill_slots, fills = split_job(gen, rng, [0, 1, 2])
        post(box, 1, hidden, rows, weights, fill_slots, (rng.randrange(W), 0))
        wait(box, 1, timeout=3.0)  # answered while its copies wait for the driver
        with pytest.raises(RuntimeError, match="job 1 posted, the last queued is job 0"):
            cpu.drain_behind(timeout_s=0.2)
        hold.set()
        cpu.drain_behind()
        assert int(box.ctrl[BEHIND]) == 1 and int(box.ctrl[ERROR]) == 0
        assert [int(slots.landed[s]) for s in fills] == list(fills.values())
    finally:
        hold.set()
        cpu.stop()


def test_the_worker_answers_while_the_copier_waits_for_the_driver(rng_seed):
    """The stall of s28-split: a driver call of the copies behind that blocks (a driver lock
    held by another thread) must not hold the next answers, which the device spins on. Jobs 2
    and 3 are answered while job 1's copies still wait for the driver; BEHIND stays at 0; once
    the driver returns, every job's copies land in order (job 1's from its snapshot, though the
    mailbox has been posted over twice since)."""
    rng, gen, w13, w2, box, cpu, slots, hold, fake = held_driver(rng_seed)
    first, want, copies = slots.snapshot(), slots.snapshot(), 0
    try:
        for seq in (1, 2, 3):
            hidden, rows, weights, fill_slots, fills = split_job(gen, rng, rng.sample(range(S), 3))
            cols = (rng.randrange(W), W)
            post(box, seq, hidden, rows, weights, fill_slots, cols)
            wait(box, seq, timeout=1.0)
            got = experts.cpu_experts(hidden, w13, w2, rows, weights, columns=cols)
            assert torch.equal(box.out[:T_MAX], got), f"job {seq}"
            want = expect(want, w13, w2, fills, *cols)
            copies += len(fills)
        assert int(box.ctrl[BEHIND]) == 0 and fake.calls == []  # job 1's copies: still held
        assert all(torch.equal(x, y) for x, y in zip(slots.snapshot(), first, strict=True))
        hold.set()
        cpu.drain_behind()
        assert int(box.ctrl[BEHIND]) == 3 and int(box.ctrl[ERROR]) == 0
        assert int(box.ctrl[BEHIND_EXPERTS]) == copies
        for name, x, y in zip(("w13", "w2", "landed"), slots.snapshot(), want, strict=True):
            assert torch.equal(x, y), name
        assert [c for c in fake.calls if c[0] == "ctx"] == [("ctx", fake.CTX)]  # once
        # Each job's copies run with BEHIND at the job before: stored after them, in order.
        assert fake.seen == sorted(fake.seen) and set(fake.seen) == {0, 1, 2}
    finally:
        hold.set()
        cpu.stop()


def test_a_full_ring_drops_copies_never_an_answer(rng_seed):
    """A ring of 2 jobs (set by the first configuration: `set_behind(ring=2)`; the driver's
    later one keeps it) and a held driver: job 1 stays in the copier's hands, job 2 queues,
    jobs 3 to 5 find the ring full. Every job is answered, BEHIND_ERROR turns -7 at job 3, and after
    the driver returns BEHIND reaches job 5 (a drain ends) with only jobs 1 and 2 copied."""
    rng, gen, w13, w2, box, cpu, slots, hold, fake = held_driver(rng_seed, ring=2)
    want, copies = slots.snapshot(), 0
    try:
        for seq in range(1, 6):
            hidden, rows, weights, fill_slots, fills = split_job(gen, rng, rng.sample(range(S), 3))
            cols = (rng.randrange(W), W)
            post(box, seq, hidden, rows, weights, fill_slots, cols)
            wait(box, seq, timeout=1.0)
            assert int(box.ctrl[BEHIND_ERROR]) == (0 if seq <= 2 else -7), f"job {seq}"
            assert int(box.ctrl[ERROR]) == 0, f"job {seq}"  # every answer was right
            if seq <= 2:
                want = expect(want, w13, w2, fills, *cols)
                copies += len(fills)
        assert int(box.ctrl[BEHIND]) == 0
        hold.set()
        cpu.drain_behind()
        assert int(box.ctrl[BEHIND]) == 5 and int(box.ctrl[BEHIND_EXPERTS]) == copies
        # The drops' BEHIND comes after the queued jobs: job 2's copies ran with BEHIND 1.
        assert fake.seen == sorted(fake.seen) and set(fake.seen) == {0, 1}
        for name, x, y in zip(("w13", "w2", "landed"), slots.snapshot(), want, strict=True):
            assert torch.equal(x, y), name
    finally:
        hold.set()
        cpu.stop()


def test_stop_makes_the_queued_copies_first(rng_seed):
    """ft_worker_stop joins the copier after the copies it was given: a stop while the driver
    holds job 1's copies (job 2's queued behind them) waits for both, and they land."""
    rng, gen, w13, w2, box, cpu, slots, hold, fake = held_driver(rng_seed)
    stopper = threading.Thread(target=cpu.stop)
    want = slots.snapshot()
    try:
        for seq in (1, 2):
            hidden, rows, weights, fill_slots, fills = split_job(gen, rng, rng.sample(range(S), 3))
            cols = (rng.randrange(W), W)
            want = expect(want, w13, w2, fills, *cols)
            post(box, seq, hidden, rows, weights, fill_slots, cols)
            wait(box, seq, timeout=1.0)
        stopper.start()
        stopper.join(0.2)
        assert stopper.is_alive()  # joining the copier, which waits for the driver
        hold.set()
        stopper.join(10)
        assert not stopper.is_alive() and not cpu.running
        assert int(box.ctrl[BEHIND]) == 2
        for name, x, y in zip(("w13", "w2", "landed"), slots.snapshot(), want, strict=True):
            assert torch.equal(x, y), name
    finally:
        hold.set()
        if stopper.is_alive():
            stopper.join(10)
        cpu.stop()


def _copiers() -> set[str]:
    """This process's copier threads (ids), named ft-copier by behind_copier.cpp."""
    found = set()
    for task in Path("/proc/self/task").iterdir():
        try:
            if (task / "comm").read_text().strip() == "ft-copier":
                found.add(task.name)
        except FileNotFoundError:  # a thread that ended meanwhile
            pass
    return found


def _cpu_s(tid: str) -> float:
    """The thread's time on a CPU in seconds (the scheduler's count in ns: clock ticks would
    charge a thread waking each millisecond for the ticks it wakes on)."""
    return int(Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[0]) / 1e9


@pytest.mark.skipif(not os.path.exists("/proc/self/schedstat"), reason="needs /proc schedstat")
def test_an_idle_copier_sleeps(rng_seed):
    """The copier must leave the cores to the kernel's SpinTeam: configured and without jobs,
    its thread runs for almost none of 0.3 s (about 4 ms here, its 1 ms wake-ups; a spinning one
    takes all of it). It starts with the first configuration and ft_worker_stop joins it."""
    gen = torch.Generator().manual_seed(rng_seed)
    _, _, _, cpu = started(gen)
    try:
        before = _copiers()
        cpu.set_behind(Slots(gen).behind())
        (tid,) = _copiers() - before
        time.sleep(0.05)
        t0 = _cpu_s(tid)
        time.sleep(0.3)
        assert _cpu_s(tid) - t0 < 0.05
    finally:
        cpu.stop()
    assert tid not in _copiers()
