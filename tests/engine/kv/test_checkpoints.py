"""CheckpointPool: round trips through both tiers, LRU spills and drops, locks, release, stats,
and a model-based randomized sequence checked against a plain-Python model after every call."""

from __future__ import annotations

import random
import warnings

import pytest
import torch

from freetoken_agent.engine.kv import checkpoints as ckpt_mod
from freetoken_agent.engine.kv.checkpoints import Checkpoint, CheckpointPool
from freetoken_agent.engine.kv.recurrent_state import RecurrentStatePool

# L layers, N state slots, C conv channels, K conv width, Hv value heads, Dk / Dv head dims
L, N, C, KM1, HV, DK, DV = 3, 5, 6, 3, 2, 3, 4
CONV, SSM = (C, KM1), (HV, DK, DV)


class Rig:
    """A state pool, a checkpoint pool, and the record of on_drop calls."""

    def __init__(self, device_rows, host_rows, dtype=torch.bfloat16, device="cpu", seed=0,
                 max_device_rows=None):  # fmt: skip
        self.gen = torch.Generator().manual_seed(seed)
        self.device = device
        self.state = RecurrentStatePool(L, N, CONV, SSM, dtype, device)
        self.dropped: list[Checkpoint] = []
        self.pool = CheckpointPool(
            L, device_rows, host_rows, CONV, SSM, dtype, device, on_drop=self.dropped.append,
            max_device_rows=max_device_rows,
        )  # fmt: skip
        self.slots = [self.state.alloc() for _ in range(N - 1)]

    def random_state(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Fresh random contents in a live slot (never zeros); returns a copy of them."""
        st = self.state
        conv = torch.randn(st.conv[:, slot].shape, generator=self.gen).to(st.conv.dtype)
        ssm = torch.randn(st.ssm[:, slot].shape, generator=self.gen, dtype=st.ssm.dtype)
        st.conv[:, slot].copy_(conv)
        st.ssm[:, slot].copy_(ssm)
        return conv, ssm

    def kernel_write(self, ckpt: Checkpoint) -> tuple[torch.Tensor, torch.Tensor]:
        """What a kernel does with a snapshot row: write every layer's slice of conv/ssm_snap."""
        p = self.pool
        conv = torch.randn(p.conv[:, ckpt.row].shape, generator=self.gen).to(p.conv.dtype)
        ssm = torch.randn(p.ssm[:, ckpt.row].shape, generator=self.gen, dtype=p.ssm.dtype)
        for layer in range(L):
            view = self.state.view(layer, p)
            view.conv_snap[ckpt.row].copy_(conv[layer])
            view.ssm_snap[ckpt.row].copy_(ssm[layer])
        return conv, ssm

    def restored(self, ckpt: Checkpoint, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Restore into a NaN-poisoned slot; returns the slot's contents on the CPU."""
        self.state.conv[:, slot].fill_(float("nan"))
        self.state.ssm[:, slot].fill_(float("nan"))
        self.pool.restore(ckpt, self.state, slot)
        return self.state.conv[:, slot].cpu(), self.state.ssm[:, slot].cpu()


def _same(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]):
    assert torch.equal(got[0], want[0].cpu()) and torch.equal(got[1], want[1].cpu())


def _filled(rig: Rig, boundary: int) -> tuple[Checkpoint, tuple[torch.Tensor, torch.Tensor]]:
    """Reserve, save a fresh random state into it, unlock."""
    ckpt = rig.pool.reserve(boundary)
    assert ckpt is not None and ckpt.locks == 1 and ckpt.tier == "device"
    want = rig.random_state(rig.slots[0])
    rig.pool.save(ckpt, rig.state, rig.slots[0])
    rig.pool.unlock(ckpt)
    return ckpt, want


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_round_trip_both_tiers_bit_exact(rng_seed, dtype):
    rig = Rig(device_rows=2, host_rows=4, dtype=dtype, seed=rng_seed)
    a, want_a = _filled(rig, 10)
    b, want_b = _filled(rig, 20)
    _same(rig.restored(a, rig.slots[1]), want_a)
    assert rig.pool.stats()["restored_from_device"] == 1
    rig.pool.touch(a)
    c, want_c = _filled(rig, 30)  # device full: b (least recently used) moves to the host
    assert b.tier == "host" and a.tier == "device" and c.tier == "device"
    assert rig.pool.host_conv.is_contiguous() and not rig.pool.pinned
    # The device row b left is c's now, rewritten: b's host copy must not see that write.
    _same(rig.restored(b, rig.slots[2]), want_b)
    _same(rig.restored(a, rig.slots[3]), want_a)
    _same(rig.restored(c, rig.slots[1]), want_c)
    stats = rig.pool.stats()
    assert stats["restored_from_host"] == 1 and stats["restored_from_device"] == 3
    assert stats["spilled"] == 1 and stats["dropped"] == 0 and not rig.dropped
    rig.pool.check_integrity()


def test_lru_spills_then_drops(rng_seed):
    """Checkpoints that cost as much to lose (one boundary, no links) drop in LRU order."""
    rig = Rig(device_rows=3, host_rows=2, seed=rng_seed)
    pool = rig.pool
    a, want_a = _filled(rig, 10)
    b, want_b = _filled(rig, 10)
    c, want_c = _filled(rig, 10)
    pool.touch(a)  # LRU order now b, c, a
    d, _ = _filled(rig, 10)
    assert b.tier == "host" and (a.tier, c.tier, d.tier) == ("device",) * 3
    e, _ = _filled(rig, 10)
    assert c.tier == "host" and a.tier == "device"
    # Host full (b, c), device LRU is a: b is older than a, so b is dropped and a spilled.
    f, _ = _filled(rig, 10)
    assert rig.dropped == [b] and b.tier == "dropped" and b.row == -1
    assert a.tier == "host" and c.tier == "host" and f.tier == "device"
    _same(rig.restored(c, rig.slots[1]), want_c)  # host restores make a and c the most
    _same(rig.restored(a, rig.slots[1]), want_a)  # recently used
    # Device LRU d is older than both host checkpoints: spilling d would drop one of them for
    # an older one, so d itself is dropped and both host checkpoints stay.
    pool.reserve(10)
    assert rig.dropped == [b, d] and (a.tier, c.tier) == ("host", "host")
    assert pool.stats()["spilled"] == 3 and pool.stats()["dropped"] == 2
    with pytest.raises(AssertionError, match="dropped"):
        pool.restore(b, rig.state, rig.slots[1])
    del want_b
    pool.check_integrity()


def test_no_host_tier_drops_lru():
    rig = Rig(device_rows=2, host_rows=0)
    a, _ = _filled(rig, 5)
    b, want_b = _filled(rig, 5)
    _filled(rig, 5)
    assert rig.dropped == [a] and b.tier == "device"
    _same(rig.restored(b, rig.slots[1]), want_b)
    assert rig.pool.stats()["host_bytes"] == 0
    rig.pool.check_integrity()


def test_locked_never_move_and_reserve_none_when_all_locked(rng_seed):
    rig = Rig(device_rows=3, host_rows=1, seed=rng_seed)
    pool = rig.pool
    held = pool.reserve(1)  # stays locked: a kernel is writing it this step
    want_held = rig.kernel_write(held)
    row = held.row
    host_locked, want_h = _filled(rig, 2)
    _filled(rig, 3)
    _filled(rig, 4)  # spills host_locked: it was the LRU unlocked device checkpoint
    assert host_locked.tier == "host"
    pool.lock(host_locked)  # being restored: the host tier's only row can no longer be freed
    for boundary in range(5, 15):
        ckpt = pool.reserve(boundary)
        rig.kernel_write(ckpt)
        pool.unlock(ckpt)
        assert held.tier == "device" and held.row == row and host_locked.tier == "host"
    _same(rig.restored(held, rig.slots[1]), want_held)
    _same(rig.restored(host_locked, rig.slots[1]), want_h)
    second, third = pool.reserve(20), pool.reserve(21)  # every device row is now locked
    assert pool.reserve(22) is None and pool.reserve(23) is None
    assert pool.stats()["reserve_skipped"] == 2 and pool.stats()["device_locked"] == 3
    assert {held.tier, second.tier, third.tier} == {"device"}
    assert all(c not in rig.dropped for c in (held, host_locked, second, third))
    pool.unlock(second)
    assert pool.reserve(24) is not None and second.tier == "dropped"  # no free host row
    pool.check_integrity()


def test_release_frees_rows_without_on_drop(rng_seed):
    rig = Rig(device_rows=2, host_rows=2, seed=rng_seed)
    pool = rig.pool
    a, _ = _filled(rig, 1)
    b, _ = _filled(rig, 2)
    c, _ = _filled(rig, 3)  # a spilled
    assert a.tier == "host"
    pool.release(a)
    pool.release(b)
    assert (a.tier, b.tier) == ("dropped", "dropped") and not rig.dropped
    s = pool.stats()
    assert (s["device_used"], s["host_used"], s["released"]) == (1, 0, 2)
    with pytest.raises(AssertionError, match="dropped or released"):
        pool.release(a)
    pool.lock(c)
    pool.release(c)  # locked: keeps its row until the last unlock
    assert c.tier == "device" and pool.stats()["device_used"] == 1
    with pytest.raises(AssertionError, match="released twice"):
        pool.release(c)
    pool.check_integrity()
    pool.unlock(c)
    assert c.tier == "dropped" and pool.stats()["device_used"] == 0 and not rig.dropped
    with pytest.raises(AssertionError):
        pool.unlock(c)
    pool.check_integrity()


def test_misuse_is_an_error():
    rig = Rig(device_rows=1, host_rows=1)
    pool = rig.pool
    a, _ = _filled(rig, 1)
    with pytest.raises(AssertionError, match="unlocked more often"):
        pool.unlock(a)
    with pytest.raises(AssertionError, match="not a live slot"):
        pool.restore(a, rig.state, 0)
    _filled(rig, 2)
    with pytest.raises(AssertionError, match="device-tier"):
        pool.save(a, rig.state, rig.slots[0])  # a is on the host now
    other = CheckpointPool(L, 1, 0, CONV, SSM, torch.bfloat16, "cpu")
    with pytest.raises(AssertionError, match="does not belong"):
        other.touch(a)
    wrong = RecurrentStatePool(L, N, CONV, SSM, torch.float32, "cpu")
    with pytest.raises(ValueError, match="does not match"):
        pool.restore(a, wrong, 1)
    pool._free["host"].append(0)  # corrupt: a used row on the free list
    with pytest.raises(AssertionError, match="also on the free list"):
        pool.check_integrity()


def test_pinning_failure_falls_back_with_one_warning(monkeypatch):
    real_empty = torch.empty

    def no_pinning(*args, pin_memory=False, **kwargs):
        if pin_memory:
            raise RuntimeError("cannot pin")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", no_pinning)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tensors, pinned = ckpt_mod._alloc_host(
            [((2, 3), torch.float32), ((4,), torch.bfloat16)], True
        )
    assert not pinned and [t.shape for t in tensors] == [(2, 3), (4,)]
    assert len(caught) == 1 and "pinning failed" in str(caught[0].message)


# --- model-based randomized sequence ------------------------------------------------------
def run_random_ops(rig: Rig, rng: random.Random, n_ops: int) -> None:
    """Random calls; a Python model predicts every tier move, drop, drop cost and counter, and
    holds the contents each live checkpoint must restore. The drop order is the module
    docstring's: GreedyDual credits over gaps that links between checkpoints set and unlinks
    pass down."""
    pool = rig.pool
    want: dict[Checkpoint, tuple[torch.Tensor, torch.Tensor]] = {}  # live, not released
    order: dict[Checkpoint, int] = {}  # model LRU clock
    locks: dict[Checkpoint, int] = {}
    gap: dict[Checkpoint, int] = {}
    credit: dict[Checkpoint, int] = {}
    prev: dict[Checkpoint, Checkpoint | None] = {}
    inflation = 0
    counts = dict.fromkeys(pool.stats()) | {k: 0 for k in ("spilled", "dropped", "released")}
    counts.update(reserve_skipped=0, restored_from_host=0, restored_from_device=0)
    clock = 0

    def tick() -> int:
        nonlocal clock
        clock += 1
        return clock

    def use(c: Checkpoint) -> None:
        order[c] = tick()
        credit[c] = inflation + gap[c]

    def gone(c: Checkpoint) -> None:
        """c leaves the model: what was linked below it falls back to c's predecessor."""
        for d in [d for d, p in prev.items() if p is c]:
            prev[d] = prev[c]
            gap[d] += gap[c]
            credit[d] += gap[c]
        for table in (order, locks, gap, credit, prev):
            del table[c]

    def on(tier: str) -> list[Checkpoint]:
        return [c for c in order if c.tier == tier]

    def cheapest(cands: list[Checkpoint]) -> Checkpoint | None:
        return min(cands, key=lambda c: (credit[c], order[c]), default=None)

    for _ in range(n_ops):
        before = {c: (c.tier, c.row) for c in order}
        drops_before = len(rig.dropped)
        expect_gone: set[Checkpoint] = set()
        live = list(want)
        op = rng.choice(
            ["reserve"] * 4
            + ["restore"] * 3
            + ["unlock"] * 3
            + ["lock", "release", "touch"]
            + ["link"] * 2
        )
        if op == "reserve":
            dev, host = on("device"), on("host")
            unlocked = [c for c in order if not locks[c]]
            victim = spilled = None
            if len(dev) == pool.device_rows:
                victim = min((c for c in dev if not locks[c]), key=order.get, default=None)
            if victim is not None:
                spilled = victim
                if len(host) == pool.host_rows:  # a drop: the cheapest of both tiers
                    dropped = cheapest(unlocked)
                    expect_gone = {dropped}
                    if dropped.tier == "device":
                        spilled = None
            ckpt = pool.reserve(rng.randrange(1, 10_000))
            if len(dev) == pool.device_rows and victim is None:
                assert ckpt is None, "reserve must fail only when every device row is locked"
                counts["reserve_skipped"] += 1
            else:
                assert ckpt is not None and ckpt.locks == 1 and ckpt.tier == "device"
                for c in expect_gone:
                    inflation = max(inflation, credit[c])
                if spilled is not None:
                    assert spilled.tier == "host", "the device LRU must be spilled"
                    counts["spilled"] += 1
                locks[ckpt], gap[ckpt], prev[ckpt] = 1, ckpt.boundary, None
                use(ckpt)
                if rng.random() < 0.5:
                    slot = rng.choice(rig.slots)
                    want[ckpt] = rig.random_state(slot)
                    pool.save(ckpt, rig.state, slot)
                    use(ckpt)
                else:
                    want[ckpt] = rig.kernel_write(ckpt)
                if rng.random() < 0.7:
                    pool.unlock(ckpt)
                    locks[ckpt] = 0
        elif op == "restore" and live:
            ckpt = rng.choice(live)
            counts[f"restored_from_{ckpt.tier}"] += 1
            _same(rig.restored(ckpt, rng.choice(rig.slots)), want[ckpt])
            use(ckpt)
        elif op == "touch" and live:
            ckpt = rng.choice(live)
            pool.touch(ckpt)
            use(ckpt)
        elif op == "link" and live:
            ckpt = rng.choice(live)
            above = [c for c in live if c.boundary < ckpt.boundary]
            p = rng.choice(above) if above and rng.random() < 0.8 else None
            pool.link(ckpt, p)
            prev[ckpt], gap[ckpt] = p, ckpt.boundary - (p.boundary if p else 0)
            credit[ckpt] = inflation + gap[ckpt]  # a fresh credit, not a use: LRU order stays
        elif op == "lock" and order:
            ckpt = rng.choice(list(order))
            pool.lock(ckpt)
            locks[ckpt] += 1
        elif op == "unlock" and any(locks.values()):
            ckpt = rng.choice([c for c in order if locks[c]])
            pool.unlock(ckpt)
            locks[ckpt] -= 1
            if not locks[ckpt] and ckpt not in want:  # released while locked
                assert ckpt.tier == "dropped"
                gone(ckpt)
        elif op == "release" and live:
            ckpt = rng.choice(live)
            pool.release(ckpt)
            counts["released"] += 1
            del want[ckpt]
            if not locks[ckpt]:
                assert ckpt.tier == "dropped"
                gone(ckpt)
            else:
                assert ckpt.tier != "dropped", "a locked checkpoint keeps its row"

        new_drops = rig.dropped[drops_before:]
        assert set(new_drops) == expect_gone and len(new_drops) == len(expect_gone)
        for c in new_drops:
            assert c.tier == "dropped" and c.row == -1
            counts["dropped"] += 1
            del want[c]
            gone(c)
        for c, where in before.items():
            if locks.get(c):
                assert (c.tier, c.row) == where, "a locked checkpoint moved"
        for c in order:
            assert (c.gap, c.credit, c.prev) == (gap[c], credit[c], prev[c]), "drop cost"
        assert pool.costs.inflation == inflation
        pool.check_integrity()
        stats = pool.stats()
        for key in ("spilled", "dropped", "released", "reserve_skipped"):
            assert stats[key] == counts[key], key
        for key in ("restored_from_host", "restored_from_device"):
            assert stats[key] == counts[key], key
        assert stats["device_used"] == len(on("device"))
        assert stats["host_used"] == len(on("host"))
    # Everything still live restores to what it was given, whichever tier it ended in.
    for ckpt, contents in want.items():
        _same(rig.restored(ckpt, rig.slots[0]), contents)


@pytest.mark.parametrize("device_rows,host_rows", [(4, 3), (3, 0), (1, 2), (6, 10), (0, 2), (2, 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_random_ops_cpu(rng_seed, device_rows, host_rows, dtype):
    rig = Rig(device_rows, host_rows, dtype=dtype, seed=rng_seed)
    run_random_ops(rig, random.Random(rng_seed), 400)
    stats = rig.pool.stats()
    assert stats["device_bytes"] == rig.pool.conv.nbytes + rig.pool.ssm.nbytes
    # The sequence must have reached the paths it is meant to check.
    if device_rows:
        assert stats["dropped"] > 0 and stats["restored_from_device"] > 0 and stats["released"]
    if device_rows and host_rows:
        assert stats["spilled"] > 0 and stats["restored_from_host"] > 0


@pytest.mark.gpu
@pytest.mark.parametrize("side_stream", [False, True])
def test_random_ops_cuda_pinned(rng_seed, side_stream):
    """On the device: spills are asynchronous copies into pinned memory, ordered with later
    writes of the same device rows only by the stream."""
    stream = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
    with torch.cuda.stream(stream):
        rig = Rig(6, 8, dtype=torch.bfloat16, device="cuda", seed=rng_seed)
        assert rig.pool.pinned and rig.pool.host_conv.is_pinned() and rig.pool.host_ssm.is_pinned()
        assert rig.pool.conv.is_cuda and not rig.pool.host_conv.is_cuda
        run_random_ops(rig, random.Random(rng_seed), 1500)
    torch.cuda.synchronize()


def test_device_tier_resizes_keeping_every_checkpoint_it_can(rng_seed):
    """A resizable device tier (lanes of reserved rows): growing adds free rows; shrinking
    moves the checkpoints above the new top to free rows below, spills the rest to the host
    tier (dropping the least recently used when that is full), never moves a locked one
    (the top stays above it), and gives the rows above back (a simulated device scribbles
    them). Every surviving checkpoint restores bit-exactly."""
    _resize_cycle(rng_seed, "cpu")


@pytest.mark.gpu
def test_cuda_device_tier_resizes_on_virtual_memory(rng_seed):
    """The same on CUDA, where the lanes are virtual memory: the kernels' views keep their
    addresses, rows above the top are unmapped, and spills and moves are exact."""
    _resize_cycle(rng_seed, "cuda")


def _mapped(pool: CheckpointPool) -> int:
    return sum(m.mapped_bytes for m, _ in pool._lanes)


def _backing(pool: CheckpointPool, rows: int) -> int:
    """Bytes mapped when rows 0..rows-1 are usable: each layer's lane holds the chunks its
    rows touch (on CUDA one 2 MiB chunk holds this rig's whole lane, so the count does not
    move there; on the simulated device a chunk is a few rows)."""
    return sum(pool.n_layers * -(-rows * row // m.chunk) * m.chunk for m, row in pool._lanes)


def _resize_cycle(rng_seed: int, device: str) -> None:
    r = random.Random(rng_seed)
    max_rows, host = r.randint(10, 16), r.randint(0, 3)
    rig = Rig(device_rows=4, host_rows=host, seed=rng_seed, max_device_rows=max_rows,
              device=device)  # fmt: skip
    views = (rig.pool.conv.data_ptr(), rig.pool.ssm.data_ptr())
    pool = rig.pool
    assert _mapped(pool) == _backing(pool, 4)
    assert pool.resize_device(max_rows) == max_rows and pool.device_rows == max_rows
    assert _mapped(pool) == _backing(pool, max_rows)
    saved = dict(_filled(rig, b) for b in range(r.randint(3, max_rows)))
    for ckpt in r.sample(list(saved), r.randint(0, len(saved) // 2)):
        pool.release(ckpt)
        del saved[ckpt]
    locked = r.choice([None, *saved])
    if locked is not None:
        pool.lock(locked)
    pool.check_integrity()
    target = r.randint(1, max_rows - 1)
    got = pool.resize_device(target)
    want_rows = max(target, locked.row + 1 if locked is not None else 0)
    assert got == want_rows == pool.device_rows
    pool.check_integrity()
    on_device = [c for c in saved if c.tier == "device"]
    assert all(c.row < got for c in on_device)
    assert len(on_device) == min(len(saved), got)  # the tier full before anything leaves it
    assert sum(c.tier == "host" for c in saved) <= host
    assert all((c.tier == "dropped") == (c in rig.dropped) for c in saved)
    for ckpt, want in saved.items():
        if ckpt.tier != "dropped":
            _same(rig.restored(ckpt, rig.slots[1]), want)
    if locked is not None:
        pool.unlock(locked)
    # The chunks wholly above the top are given back, no more and no fewer.
    assert _mapped(pool) == _backing(pool, got)
    # And it grows again, its free rows usable.
    assert pool.resize_device(max_rows) == max_rows
    assert _mapped(pool) == _backing(pool, max_rows)
    fresh, want = _filled(rig, 999)
    _same(rig.restored(fresh, rig.slots[1]), want)
    pool.check_integrity()
    assert (pool.conv.data_ptr(), pool.ssm.data_ptr()) == views  # the kernels' views stay


def test_fixed_device_tier_cannot_resize():
    rig = Rig(device_rows=3, host_rows=1)
    with pytest.raises(ValueError, match="fixed size"):
        rig.pool.resize_device(5)
