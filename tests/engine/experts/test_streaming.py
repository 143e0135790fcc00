"""The prefill streamer (engine/experts/streaming.py): resident experts read in their slots,
absent ones staged group by group through the ring, and only those crossing the link.

Shape legend: N = L * E lids, T tokens, K top-k, H hidden, I expert width.
"""

import random

import pytest
import torch

from freetoken_agent.engine.arena import ElasticArena, KVUnit, SlotUnit
from freetoken_agent.engine.experts import streaming
from freetoken_agent.engine.experts.cache import ExpertCache
from freetoken_agent.engine.experts.pool import ExpertPool
from freetoken_agent.engine.experts.streaming import LayerStreamer, lid_runs
from freetoken_agent.kernels.fused_moe import fused_moe


def test_lid_runs_stay_inside_pinned_registrations(rng_seed):
    rng = random.Random(rng_seed)
    for _ in range(300):
        pin = rng.randrange(1, 12)
        lids = sorted(rng.sample(range(200), rng.randrange(1, 40)))
        runs = lid_runs(lids, pin)
        assert [i for i0, i1 in runs for i in range(i0, i1)] == list(range(len(lids)))  # once
        for i0, i1 in runs:
            assert lids[i1 - 1] - lids[i0] == i1 - i0 - 1  # consecutive rows: one copy
            assert lids[i0] // pin == lids[i1 - 1] // pin  # one registration per copy
        for (_, a), (b, _) in zip(runs, runs[1:], strict=False):  # maximal: cut only where due
            assert lids[b] != lids[a - 1] + 1 or lids[b] % pin == 0


def _setup(rng: random.Random, arena: bool, device: torch.device, big: bool):
    """A pool of L layers of E experts, a cache of some slots (on an arena or its own), and
    a random resident set filled in a random order. `big`: CUDA-sized experts, whose copies
    take long enough for a missing wait to let compute read a buffer before it lands."""
    n_layers, e = rng.randrange(2, 5), rng.randrange(3, 9)
    h, i = (rng.choice([512, 1024]), 256) if big else (rng.choice([8, 16]), rng.choice([4, 8]))
    n = n_layers * e
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    # std 2/sqrt(fan_in) keeps gate, act and out O(1): unscaled, outputs reach 1e4 and the
    # parts' fp32 sum order alone moves near-zero elements past any elementwise tolerance.
    w13 = torch.randn(n, 2 * i, h, generator=g) * (2 / h**0.5)
    pool = ExpertPool(w13, torch.randn(n, h, i, generator=g) * (2 / i**0.5))
    pool.pin_rows = rng.randrange(1, n + 1)  # registrations a copy must not span
    if device.type == "cuda":
        assert pool.pin()
    slots = rng.randrange(1, n + 4)
    if arena:
        kv = KVUnit(1, 3, 1, 5, torch.float32)
        unit = SlotUnit(h, i, torch.float32)
        a = ElasticArena((slots + 2) * unit.nbytes + 7, device, kv, unit)
        a.slot_buffer.fill_(0xFF)  # NaN: a slot read before its fill shows up
        a.set_boundary(a.boundary_for(n_slots=slots))
        cache = ExpertCache(pool, 0, device, lids_per_layer=e, arena=a)
    else:
        cache = ExpertCache(pool, slots, device, lids_per_layer=e)
    want = rng.sample(range(n), rng.randrange(0, n + 1))
    cache.fill(want, set(), race=False)
    return pool, cache, n_layers, e


def _inputs(t: int, k: int, e: int, pool: ExpertPool, device: torch.device):
    """hidden [T, H], topk_ids [T, K] int32 (distinct experts a token), weights [T, K] fp32."""
    hidden = torch.randn(t, pool.w13.shape[2], device=device)
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)]).int().to(device)
    return hidden, ids, torch.rand(t, k, device=device)


def check_streamer(rng: random.Random, arena: bool, device: torch.device, monkeypatch) -> None:
    """Every layer's output equals the fused MoE over the pool's own rows (the all-resident
    computation) within fp32 rounding of the sum's order, in every arrangement of resident
    experts, ring size, buffers and lending; the bytes that cross are exactly the experts
    absent when the chunk began, and the resident ones stay resident."""
    big = device.type == "cuda"
    uploads = []  # the host lists each chunk puts on the device
    real_on_device = streaming.on_device
    monkeypatch.setattr(streaming, "on_device", lambda v, *a: uploads.append(v) or
                        real_on_device(v, *a))  # fmt: skip
    for _ in range(25 if not big else 12):
        monkeypatch.setattr(streaming, "STREAM_GROUP", rng.randrange(1, 6))
        # Groups grow with the chunk's tokens (chunk_group): some chunks take bigger ones.
        monkeypatch.setattr(streaming, "STREAM_GROUP_TOKENS", rng.randrange(4, 64))
        pool, cache, n_layers, e = _setup(rng, arena, device, big)
        double = rng.random() < 0.5
        b = 2 if double else 1
        ring = streaming.ring_slots(e, b)
        lend = ring + e <= cache.n_slots and rng.random() < 0.7  # as lends_staging
        streamer = LayerStreamer(pool, cache, e, n_layers, device, double, lend)
        own = 0 if lend else ring * pool.expert_bytes
        assert streamer.ring_rows == ring and streamer.nbytes == own
        for chunk in range(2):  # a second chunk plans from the cache the first left
            t, k = rng.randrange(1, 40 if not big else 400), rng.randrange(1, e + 1)
            if rng.random() < 0.4:  # a chunk that fails midway: the next starts afresh
                for layer in range(rng.randrange(1, n_layers)):
                    streamer.moe(layer, *_inputs(t, k, e, pool, device))
            room = cache.n_slots - e if lend else ring
            group = streaming.chunk_group(t, e, b, room)
            if lend:  # wider while the lend evicts little (widest_group)
                group = streaming.widest_group(group, e, b, room, cache.n_resident, cache.n_slots,
                                               pool.n_rows)  # fmt: skip
            chunk_ring = b * group
            if lend:  # what the lend leaves resident: the ring's worth of coldest go first
                stay = cache.n_slots - chunk_ring
                keep = set(list(cache._lru)[max(0, len(cache._lru) - stay) :])
            else:
                keep = set(cache._lru)
            slots = {lid: cache._slot_of[lid] for lid in keep}
            before = streamer.bytes_h2d
            uploads.clear()
            outs, wants = [], []
            for layer in range(n_layers):
                hidden, ids, weights = _inputs(t, k, e, pool, device)
                outs.append(streamer.moe(layer, hidden, ids, weights))
                rows = slice(layer * e, (layer + 1) * e)
                # (through a pageable copy: one copy must not span two pinned registrations)
                w13, w2 = pool.w13[rows].clone().to(device), pool.w2[rows].clone().to(device)
                wants.append(fused_moe(hidden, w13, w2, ids, weights))
                if all(lid in keep for lid in range(rows.start, rows.stop)):  # one launch
                    bank_ids = cache.slot_of[ids.long() + rows.start]
                    assert torch.equal(
                        outs[-1], fused_moe(hidden, cache.w13, cache.w2, bank_ids, weights)
                    )
            for layer, (out, want) in enumerate(zip(outs, wants, strict=True)):
                err = ((out - want).norm() / want.norm()).item()  # fp32: the sum's order
                assert err < 1e-5, f"layer {layer}: relative error {err:.2e}"
            # The launches' row maps crossed once, at the chunk's start: a copy at each layer
            # would queue on the compute stream behind the expert copies (streaming._plan).
            assert len(uploads) == 1, len(uploads)
            absent = n_layers * e - len(keep)
            assert streamer.bytes_h2d - before == absent * pool.expert_bytes, chunk
            # Read in place: nothing evicted or filled but the lend's (which moves the ring's
            # tenants out of its range, as a shrink does).
            assert {lid for lid, slot in enumerate(cache._slot_of) if slot >= 0} == keep
            if not lend:
                assert {lid: cache._slot_of[lid] for lid in keep} == slots
            assert not streamer.active and cache.lent == 0 and not streamer.borrowing
            cache.check_integrity()


@pytest.mark.parametrize("arena", [False, True])
def test_streamer_matches_the_whole_bank_and_moves_only_absent_experts(rng_seed, arena,
                                                                       monkeypatch):  # fmt: skip
    check_streamer(random.Random(rng_seed), arena, torch.device("cpu"), monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("arena", [False, True])
def test_streamer_on_cuda_matches_the_whole_bank(rng_seed, arena, monkeypatch):
    """The same on CUDA, pinned: copies on the copy stream, each group's compute waiting for
    its buffer and each buffer's next copy for the compute that read it."""
    check_streamer(random.Random(rng_seed), arena, torch.device("cuda"), monkeypatch)


def test_chunk_group_grows_with_tokens_within_its_bounds(rng_seed):
    rng = random.Random(rng_seed)
    for _ in range(500):
        e, b = rng.randrange(1, 200), rng.choice([1, 2])
        most = rng.randrange(0, 600)
        t1 = rng.randrange(1, 40000)
        t2 = t1 + rng.randrange(0, 40000)
        g1, g2 = (streaming.chunk_group(t, e, b, most) for t in (t1, t2))
        floor = min(streaming.STREAM_GROUP, e)
        assert floor <= g1 <= g2 <= max(floor, min(e, most // b))  # never past E or the room
        if most // b >= e:  # room for any group: as many as the tokens ask, up to E
            want = streaming.STREAM_GROUP * -(-t2 // streaming.STREAM_GROUP_TOKENS)
            assert g2 == max(floor, min(e, want))


def test_widest_group_evicts_little_or_keeps_its_least(rng_seed):
    rng = random.Random(rng_seed)
    for _ in range(2000):
        e, b = rng.randrange(1, 200), rng.choice([1, 2])
        n_rows = e * rng.randrange(1, 60) + b
        n_slots = rng.randrange(b, n_rows + 1)
        resident = rng.randrange(0, n_slots + 1)
        most = rng.randrange(b, n_slots + 1)
        least = min(rng.randrange(1, e + 1), most // b) or 1
        g = streaming.widest_group(least, e, b, most, resident, n_slots, n_rows)
        evicted = max(0, resident - (n_slots - b * g))
        assert least <= g <= max(least, min(e, most // b))
        if g > least:  # widened: within the share of what streams anyway
            assert evicted <= streaming.RING_EVICTS * (n_rows - resident)
        if g < min(e, most // b):  # one wider would evict too many
            wider = max(0, resident - (n_slots - b * (g + 1)))
            assert g == least or wider > streaming.RING_EVICTS * (n_rows - resident)
        if resident + b * min(e, most // b) <= n_slots:  # room for whole rings: evicts none
            assert g == max(least, min(e, most // b))
