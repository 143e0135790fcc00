"""The elastic-memory policy, its trace and the budget watcher (engine/memory.py), on random
demands. A cache is modelled as experts ranked by hit rate: n slots hold the n hottest, so
`tail_hits(k)` (the k coldest of them) stays consistent as the policy resizes the cache."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest

from freetoken_agent.engine.memory import (
    GIB,
    BudgetWatcher,
    MemoryDemand,
    MemoryPolicy,
    MemoryTrace,
    Split,
)

MIB = 1 << 20


def tail_fn(rates: list[float], n: int):
    """hits/step of the k coldest of the n hottest experts (rates sorted hottest first)."""
    held = rates[:n]
    return lambda k: float(sum(held[len(held) - k :])) if k > 0 else 0.0


def demand(rng: random.Random, rates: list[float] | None = None, **kw) -> MemoryDemand:
    page_bytes = rng.choice([1, 2, 3, 5]) * MIB // rng.choice([1, 2, 4])
    slot_bytes = rng.choice([0, 3 * MIB, 6_291_456, 25 * MIB, 80 * MIB])
    max_slots = rng.randint(50, 3000)
    rates = rates or sorted((rng.expovariate(1.0) for _ in range(max_slots)), reverse=True)
    slots_now = rng.randint(0, max_slots + 5)
    d = dict(
        budget=rng.randint(1, 40) * GIB + rng.randint(0, GIB),
        fixed=rng.randint(0, 8) * GIB + rng.randint(0, GIB),
        page_bytes=page_bytes,
        slot_bytes=slot_bytes,
        pages_now=rng.randint(0, 20000),
        slots_now=slots_now,
        pages_held=rng.randint(0, 8000),
        pages_growth=rng.randint(0, 500),
        pages_waiting=rng.choice([0, rng.randint(1, 4000)]),
        cached_recent=rng.randint(0, 4000),
        cached_stale=rng.randint(0, 4000),
        min_slots=rng.randint(0, 40),
        max_slots=max_slots,
        slot_tail_hits=tail_fn(rates, slots_now),
    )
    d.update(kw)
    return MemoryDemand(**d)


def apply(d: MemoryDemand, s: Split | None, rates: list[float]) -> MemoryDemand:
    """The engine carried the split out: the next safe point sees it."""
    if s is None:
        return d
    return replace(d, pages_now=s.pages, slots_now=s.slots, slot_tail_hits=tail_fn(rates, s.slots))


def check_split(d: MemoryDemand, s: Split | None, policy: MemoryPolicy) -> None:
    pb, sb = d.page_bytes, d.slot_bytes
    avail = d.budget - d.fixed
    running = d.pages_held + d.pages_growth
    min_slots = d.min_slots if sb else d.slots_now
    over = avail < running * pb + min_slots * sb
    waiting_fits = avail >= (running + d.pages_waiting) * pb + min_slots * sb
    hard = running + (d.pages_waiting if waiting_fits else 0)
    if s is None:  # keeping the split is only allowed when it is valid
        assert not over
        assert d.pages_now * pb + d.slots_now * sb <= avail
        assert d.pages_now >= hard and d.slots_now >= min_slots
        return
    assert s.pages >= 0 and s.slots >= 0
    if avail >= 0:
        assert d.fixed + s.pages * pb + s.slots * sb <= d.budget, (d, s)
    assert (s.reason == "over budget") == over, (s, over)
    if over:
        if avail >= min_slots * sb:
            assert s.slots == min_slots and s.pages == (avail - min_slots * sb) // pb
        return
    assert s.pages >= hard, (s, hard)
    assert s.slots >= min_slots
    if sb == 0:
        assert s.slots == d.slots_now
    moved = abs(s.slots - d.slots_now) * sb
    hard_forced = s.reason.startswith("hard")
    if not hard_forced:  # no sub-group moves unless level 1 needs them
        assert moved >= policy.group_bytes or (
            moved == 0 and abs(s.pages - d.pages_now) * pb >= policy.group_bytes
        ), (d, s)
    else:
        cur_ok = d.pages_now * pb + d.slots_now * sb <= avail and d.pages_now >= hard
        assert not cur_ok or d.slots_now < min_slots, "a hard move while the split was valid"


def test_budget_invariant_and_hard_demand(rng_seed):
    rng = random.Random(rng_seed)
    n_over = n_moves = n_none = 0
    for _ in range(300):
        policy = MemoryPolicy(group_bytes=rng.choice([16, 64, 256]) * MIB)
        d = demand(rng)
        rates = sorted((rng.expovariate(1.0) for _ in range(d.max_slots)), reverse=True)
        d = replace(d, slot_tail_hits=tail_fn(rates, d.slots_now))
        for _ in range(6):  # a few safe points on a drifting demand
            s = policy.decide(d)
            check_split(d, s, policy)
            n_over += s is not None and s.reason == "over budget"
            n_moves += s is not None
            n_none += s is None
            d = apply(d, s, rates)
            d = replace(
                d,
                pages_held=max(0, d.pages_held + rng.randint(-300, 300)),
                budget=d.budget + rng.choice([0, 0, rng.randint(-GIB, GIB)]),
            )
    assert n_over and n_moves and n_none  # every branch was exercised


def session(rng: random.Random, rates: list[float], slot_bytes: int) -> MemoryDemand:
    return MemoryDemand(
        budget=24 * GIB,
        fixed=4 * GIB,
        page_bytes=2 * MIB,
        slot_bytes=slot_bytes,
        pages_now=1024,
        slots_now=(20 * GIB - 1024 * 2 * MIB) // slot_bytes,
        pages_held=0,
        pages_growth=0,
        pages_waiting=0,
        cached_recent=0,
        cached_stale=rng.randint(0, 500),
        min_slots=16,
        max_slots=len(rates),
        slot_tail_hits=tail_fn(rates, (20 * GIB - 1024 * 2 * MIB) // slot_bytes),
    )


def test_growing_context_takes_slots_then_release_gives_them_back(rng_seed):
    rng = random.Random(rng_seed)
    slot_bytes = rng.choice([6_291_456, 12 * MIB])
    rates = [1.0 + rng.random() for _ in range(4000)]  # hot everywhere: only demand moves them
    policy = MemoryPolicy(min_gap=4)
    d = session(rng, rates, slot_bytes)
    for _ in range(3):  # settle: free pages beyond the demand go to slots first
        d = apply(d, policy.decide(d), rates)
    slots0 = d.slots_now
    prev = d.slots_now
    for _ in range(60):  # the context grows by ~150 pages (300 MiB) a safe point
        d = replace(d, pages_held=d.pages_held + rng.randint(100, 200), pages_growth=64)
        s = policy.decide(d)
        check_split(d, s, policy)
        d = apply(d, s, rates)
        assert d.slots_now <= prev
        prev = d.slots_now
    assert d.pages_now >= d.pages_held + d.pages_growth
    assert d.slots_now < slots0 - 5 * GIB // slot_bytes  # gigabytes moved to KV
    grown = d.slots_now
    # The session ends: its pages are cached but stale, nothing runs.
    d = replace(d, cached_stale=d.pages_held, pages_held=0, pages_growth=0)
    for _ in range(10):
        s = policy.decide(d)
        check_split(d, s, policy)
        d = apply(d, s, rates)
    assert d.slots_now > grown
    assert d.slots_now >= min(len(rates), (20 * GIB) // slot_bytes) - policy.group_slots(slot_bytes)


@pytest.mark.parametrize("hot", [False, True])
def test_cold_slots_yield_to_recent_pages_hot_ones_do_not(rng_seed, hot):
    rng = random.Random(rng_seed)
    slot_bytes = 6_291_456
    n_hot = rng.randint(300, 800)
    # cold: a hot head then ~0; hot: every slot earns well above the threshold
    rates = [5.0 + rng.random() for _ in range(n_hot)]
    rates += [(5.0 if hot else 1e-4) * (1 + rng.random()) for _ in range(4000 - n_hot)]
    rates.sort(reverse=True)
    d = session(rng, rates, slot_bytes)
    # recent KV that fits beside the hot slots only: knee + recent + running > the budget
    room = d.budget - d.fixed - 532 * d.page_bytes - n_hot * slot_bytes
    recent = room // d.page_bytes + rng.randint(0, 1000)
    d = replace(d, pages_held=500, pages_growth=32, cached_recent=recent)
    policy = MemoryPolicy()
    s = policy.decide(d)
    check_split(d, s, policy)
    if hot:
        assert s is None or s.slots >= d.slots_now  # the cache keeps what it uses
        assert (s.pages if s else d.pages_now) < 532 + recent
    else:
        assert s is not None and s.reason == "cold slots"
        g = policy.group_slots(slot_bytes)
        assert n_hot <= s.slots <= n_hot + g  # cut to the knee, not into the hot head
        # every byte past the hot slots went to KV (recent pages fill it)
        assert s.pages >= 532 + room // d.page_bytes - (g + 1) * slot_bytes // d.page_bytes


class EagerKnee(MemoryPolicy):
    """The policy as it was: the knee profiled at every decision."""

    @staticmethod
    def _contested(d, rem, min_slots, max_slots) -> bool:
        return True


class CountedKnee(MemoryPolicy):
    knees = 0

    def _knee(self, d, min_slots):
        self.knees += 1
        return super()._knee(d, min_slots)


def test_knee_skipped_only_where_it_cannot_change_the_split(rng_seed):
    """Skipping the knee's LRU profile (no recent pages, or room for all of them and every
    slot) leaves every split as profiling it at every decision gave. Labels may differ there
    only from "cold slots" to "kv demand": nothing cold was given up for recent pages."""
    rng = random.Random(rng_seed)
    skipped = 0
    for _ in range(3000):
        d = demand(rng)
        if rng.random() < 0.3:  # decode-like: nothing recent, or plenty of room
            d = replace(d, cached_recent=0 if rng.random() < 0.5 else rng.randint(1, 50),
                        budget=d.budget + rng.choice([0, 40 * GIB]))  # fmt: skip
        lazy = CountedKnee()
        got, want = lazy.decide(d), EagerKnee().decide(d)
        skipped += not lazy.knees
        check_split(d, got, lazy)
        assert (got is None) == (want is None), (d, got, want)
        if got is not None:
            assert (got.pages, got.slots) == (want.pages, want.slots), (d, got, want)
            assert got.reason == want.reason or (
                want.reason.replace("cold slots", "kv demand") == got.reason
            ), (got, want)
    assert skipped > 300  # the skip is taken, not just allowed


def test_stable_demand_does_not_oscillate(rng_seed):
    rng = random.Random(rng_seed)
    for _ in range(40):
        policy = MemoryPolicy()
        d = demand(rng)
        rates = sorted((rng.expovariate(1.0) for _ in range(d.max_slots)), reverse=True)
        d = replace(d, slot_tail_hits=tail_fn(rates, d.slots_now))
        moves = []
        for _ in range(30):
            s = policy.decide(d)
            check_split(d, s, policy)
            if s is not None and (s.pages, s.slots) != (d.pages_now, d.slots_now):
                moves.append(s)  # "over budget" repeats while it lasts: the engine preempts
            d = apply(d, s, rates)
        assert len(moves) <= 2, moves  # at most one move (and one hard fix-up) then quiet


def test_no_back_and_forth_within_min_gap(rng_seed):
    rng = random.Random(rng_seed)
    slot_bytes = 6_291_456
    n_hot = rng.randint(300, 800)
    rates = [5.0 + rng.random() for _ in range(n_hot)] + [1e-4] * (4000 - n_hot)
    policy = MemoryPolicy(min_gap=rng.randint(5, 12))
    d = session(rng, rates, slot_bytes)
    big = rng.randint(2000, 3000)  # ~5 GiB of cached KV turns recent and stale every safe point
    last_dir, last_at, n_moves = 0, -100, 0
    for t in range(200):
        recent = big if t % 2 else 0
        d = replace(d, pages_held=100, cached_stale=big - recent, cached_recent=recent)
        s = policy.decide(d)
        check_split(d, s, policy)
        if s is not None and s.slots != d.slots_now:
            assert not s.reason.startswith("hard")
            direction = 1 if s.slots > d.slots_now else -1
            if direction == -last_dir:
                assert t - last_at >= policy.min_gap, (t, last_at)
            last_dir, last_at, n_moves = direction, t, n_moves + 1
        d = apply(d, s, rates)
    assert n_moves >= 200 // (policy.min_gap + 2) - 1  # it does follow the demand, slowly
    assert n_moves <= 200 // policy.min_gap + 1


def test_over_budget(rng_seed):
    rng = random.Random(rng_seed)
    d = demand(rng, slot_bytes=6_291_456)
    d = replace(d, budget=d.fixed + rng.randint(1, 8) * GIB + rng.randint(0, GIB))
    avail = d.budget - d.fixed
    held = avail // d.page_bytes + rng.randint(1, 1000)
    d = replace(d, pages_held=held, pages_growth=rng.randint(0, 100))
    s = MemoryPolicy().decide(d)
    assert s is not None and s.reason == "over budget"
    assert s.pages < held
    assert d.fixed + s.pages * d.page_bytes + s.slots * d.slot_bytes <= d.budget
    assert s.pages == (avail - s.slots * d.slot_bytes) // d.page_bytes


class FakeGPU:
    """A device of `total` bytes shared by the engine (it uses its budget) and others."""

    def __init__(self, total: int) -> None:
        self.total, self.others, self.engine, self.reads = total, 0, 0, 0

    def free(self) -> tuple[int, int]:
        self.reads += 1
        return self.total - self.others - self.engine, self.total


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def watcher(gpu: FakeGPU, clock: Clock, configured=None, reserve=GIB, poll_s=0.5):
    return BudgetWatcher(
        configured, reserve, poll_s, gpu.free, lambda: gpu.engine, group_bytes=64 * MIB, clock=clock
    )


def test_watcher_shrinks_by_shortfall_and_regrows(rng_seed):
    rng = random.Random(rng_seed)
    gpu, clock = FakeGPU(rng.randint(60, 140) * GIB), Clock()
    gpu.others = rng.randint(0, 4) * GIB
    w = watcher(gpu, clock)
    b0 = w.poll()
    assert b0 == gpu.total - gpu.others - GIB
    gpu.engine = b0  # the engine grows into its budget: free == reserve
    taken = rng.randint(2, 20) * GIB + rng.randint(0, GIB)
    gpu.others += taken
    assert w.poll() == b0  # not yet: poll_s has not passed
    clock.t += 0.5
    b1 = w.poll()
    assert b1 == b0 - taken  # shortfall = reserve - free = taken
    gpu.engine = b1
    gpu.others += 10 * MIB  # noise below a group still costs the shortfall (no OOM)
    clock.t += 1
    assert w.poll() == b1 - 10 * MIB
    gpu.engine = w.budget
    gpu.others -= 10 * MIB  # released noise below a group: no regrow (hysteresis)
    clock.t += 1
    assert w.poll() == b1 - 10 * MIB
    gpu.others -= taken  # the other process exits
    clock.t += 1
    assert w.poll() == b0  # back, and no further than total - reserve
    gpu.others = 0
    clock.t += 1
    assert w.poll() == gpu.total - GIB


def test_watcher_configured_and_set_budget(rng_seed):
    rng = random.Random(rng_seed)
    gpu, clock = FakeGPU(80 * GIB), Clock()
    configured = rng.randint(10, 40) * GIB
    w = watcher(gpu, clock, configured=configured)
    assert w.poll() == configured
    gpu.engine = configured
    gpu.others = 80 * GIB - configured - GIB + 3 * GIB  # others leave 3 GiB short of reserve
    clock.t += 1
    assert w.poll() == configured - 3 * GIB
    gpu.engine = w.budget
    gpu.others -= 3 * GIB
    clock.t += 1
    assert w.poll() == configured  # regrows to the configured budget, not past it
    user = configured - rng.randint(1, 8) * GIB
    reads = gpu.reads
    w.set_budget(user)
    assert w.poll() == user and gpu.reads == reads  # at once, without a read
    gpu.engine = user
    clock.t += 1
    assert w.poll() == user  # free memory does not lift the user's budget
    w.set_budget(None)
    clock.t += 1
    assert w.poll() == configured


def test_watcher_polls_no_more_often_than_poll_s(rng_seed):
    rng = random.Random(rng_seed)
    gpu, clock = FakeGPU(80 * GIB), Clock()
    poll_s = rng.uniform(0.05, 2.0)
    w = watcher(gpu, clock, poll_s=poll_s)
    reads_at = []
    for _ in range(500):
        before = gpu.reads
        w.poll()
        if gpu.reads > before:
            reads_at.append(clock.t)
        clock.t += rng.uniform(0, poll_s / 5)
    gaps = [b - a for a, b in zip(reads_at[:-1], reads_at[1:], strict=True)]
    assert gaps and min(gaps) >= poll_s
    assert len(reads_at) >= (clock.t - 1000.0) / (poll_s * 1.3)  # and it does poll


def test_trace_bounded_keeps_first_and_latest(rng_seed):
    rng = random.Random(rng_seed)
    clock = Clock()
    first, last = rng.randint(2, 10), rng.randint(5, 30)
    trace = MemoryTrace(keep_first=first, keep_last=last, clock=clock)
    n = first + last + rng.randint(1, 100)
    for i in range(n):
        clock.t += 0.1
        trace.record(
            step=i,
            budget=GIB,
            kv_bytes=i * MIB,
            checkpoint_bytes=0,
            slots=i,
            slot_bytes=i * 6 * MIB,
            pages=i,
            reason="kv demand",
        )
    steps = [r.step for r in trace.records]
    assert steps == list(range(first)) + list(range(n - last, n))
    data = json.loads(json.dumps(trace.to_json()))
    assert data["dropped"] == n - first - last
    assert [r["step"] for r in data["records"]] == steps
    assert data["records"][1]["time"] == pytest.approx(0.2)


def test_plot_split_writes_png(rng_seed, tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed")
    from freetoken_agent.bench.memory_plot import plot_split

    rng = random.Random(rng_seed)
    rates = [1.0 + rng.random() for _ in range(4000)]
    clock = Clock()
    trace = MemoryTrace(clock=clock)
    policy = MemoryPolicy(min_gap=2)
    d = session(rng, rates, 6_291_456)
    for step in range(120):
        clock.t += 0.25
        held = step * 40 if step < 80 else 0
        budget = 24 * GIB if not 50 <= step < 70 else 20 * GIB
        d = replace(d, pages_held=held, cached_stale=0 if held else 3200, budget=budget)
        s = policy.decide(d)
        if s is not None:
            d = apply(d, s, rates)
            trace.record(
                step=step,
                budget=budget,
                kv_bytes=s.pages * d.page_bytes,
                checkpoint_bytes=GIB // 4,
                slots=s.slots,
                slot_bytes=s.slots * d.slot_bytes,
                pages=s.pages,
                reason=s.reason,
                fixed_bytes=d.fixed - GIB // 4,
            )
    path = tmp_path / "split.png"
    turns = [(t * 5.0, 40 + 20 * rng.random()) for t in range(6)]
    plot_split(trace.to_json(), path, title="test session", turns=turns)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert 10_000 < len(data) < 5_000_000


def test_an_idle_engine_keeps_min_pages_within_the_budget(rng_seed):
    """An idle engine holds the scratch page alone (pages_held 1), but the engine never keeps
    fewer than min_pages: the policy counts them, so the split it answers (min_pages or more
    pages) fits the budget. It used to give every byte past one page to slots, and the split
    raised to two pages held up to a slot more than the budget."""
    rng = random.Random(rng_seed)
    for _ in range(200):
        d = demand(rng, pages_held=1, pages_growth=0, pages_waiting=0, cached_recent=0,
                   slot_bytes=rng.choice([3 * MIB, 25 * MIB]),
                   pages_now=rng.randint(2, 64))  # fmt: skip
        fixed = d.fixed
        # Just above the floor: min_pages and min_slots, plus a fraction of a few pages.
        floor = fixed + d.min_pages * d.page_bytes + d.min_slots * d.slot_bytes
        d = replace(d, budget=floor + int(rng.uniform(0, 6) * d.page_bytes))
        s = MemoryPolicy(group_bytes=rng.choice([16, 64]) * MIB).decide(d)
        pages, slots = (s.pages, s.slots) if s is not None else (d.pages_now, d.slots_now)
        if s is not None:
            assert pages >= d.min_pages
            assert fixed + pages * d.page_bytes + slots * d.slot_bytes <= d.budget


def test_a_waiting_request_that_fits_is_admitted_on_an_idle_engine(rng_seed):
    """An idle engine (the scratch page alone) with a request waiting for W pages, under a
    budget of exactly 1 + W pages and min_slots: its pages are the hard demand. The policy
    used to count min_pages' page to run in, then the request's W on top (one page twice),
    drop the request from the hard level, and give its pages to slots: it then failed for
    want of KV it had room for."""
    rng = random.Random(rng_seed)
    for _ in range(200):
        waiting = rng.randint(1, 40)
        d = demand(rng, pages_held=1, pages_growth=0, pages_waiting=waiting,
                   pages_waiting_least=rng.randint(1, waiting), cached_recent=0,
                   slot_bytes=rng.choice([3 * MIB, 25 * MIB]))  # fmt: skip
        budget = d.fixed + (1 + waiting) * d.page_bytes + d.min_slots * d.slot_bytes
        d = replace(d, budget=budget + rng.randrange(d.page_bytes))  # not a page more
        s = MemoryPolicy(group_bytes=rng.choice([16, 64]) * MIB).decide(d)
        pages = d.pages_now if s is None else s.pages
        assert pages >= 1 + waiting, (waiting, s)
        check_split(d, s, MemoryPolicy())


def test_without_room_for_its_lookahead_a_waiting_request_keeps_its_prompts_pages(rng_seed):
    """The first waiting request's lookahead (its prompt and up to 256 answer tokens) does not
    fit, its prompt and first token do: those are hard, so it is admitted and grows as it
    decodes (it used to be left with no page at all, and failed though it fit)."""
    rng = random.Random(rng_seed)
    for _ in range(200):
        held, least = rng.randint(1, 30), rng.randint(1, 30)
        waiting = least + rng.randint(1, 20)
        d = demand(rng, pages_held=held, pages_growth=0, pages_waiting=waiting,
                   pages_waiting_least=least, cached_recent=0,
                   slot_bytes=rng.choice([3 * MIB, 25 * MIB]))  # fmt: skip
        room = max(held + least, d.min_pages) + rng.randint(0, waiting - least - 1)
        d = replace(d, budget=d.fixed + room * d.page_bytes + d.min_slots * d.slot_bytes)
        s = MemoryPolicy(group_bytes=rng.choice([16, 64]) * MIB).decide(d)
        pages = d.pages_now if s is None else s.pages
        assert pages >= held + least, (held, least, waiting, room, s)
