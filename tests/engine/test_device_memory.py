"""The arena's backing memory: chunks mapped where pages or slots are in use, the gap between
them released (scribbled on the CPU; given back to the driver on CUDA), mapped again on growth.

Shape legend: P pages, S_max slots; sizes in bytes.
"""

import random

import pytest
import torch

from freetoken_agent.engine.arena import ElasticArena, KVUnit, SlotUnit
from freetoken_agent.engine.device_memory import SimulatedMemory


def test_simulated_chunks_map_release_and_scribble(rng_seed):
    r = random.Random(rng_seed)
    chunk = r.choice([64, 96, 128])
    n_chunks = r.randint(6, 12)
    nbytes = chunk * n_chunks - r.randint(0, chunk - 1)  # a short last chunk
    mem = SimulatedMemory(nbytes, torch.device("cpu"), chunk)
    assert mem.mapped_bytes == 0 and mem.releases
    lo, hi = r.randint(0, nbytes // 2), r.randint(nbytes // 2 + 1, nbytes)
    assert mem.map(lo, hi)
    touched = range(lo // chunk, -(-hi // chunk))  # every chunk touching [lo, hi)
    assert mem.mapped == [c in touched for c in range(mem.n_chunks)]
    assert mem.is_mapped(lo, hi) and mem.mapped_bytes == len(touched) * chunk
    data = torch.randint(0, 255, (hi - lo,), dtype=torch.uint8)
    mem.view()[lo:hi] = data
    # Release the middle: only chunks wholly inside go, and their bytes are scribbled.
    a, b = lo + r.randint(0, chunk), hi - r.randint(0, chunk)
    whole = range(-(-a // chunk), b // chunk)
    assert mem.releasable(a, b) == any(c in touched for c in whole)
    freed = mem.unmap(a, b)
    assert freed == sum(1 for c in whole if c in touched) * chunk
    for c in range(mem.n_chunks):
        assert mem.mapped[c] == (c in touched and c not in whole)
    view = mem.view()
    for c in whole:
        assert bool((view[c * chunk : min((c + 1) * chunk, nbytes)] == 0xFF).all())
    kept = [i for i in range(lo, hi) if i // chunk not in whole]
    assert torch.equal(view[kept], data[[i - lo for i in kept]])
    assert not mem.releasable(a, b) and mem.unmap(a, b) == 0
    # A kept chunk (under a view's first element) survives every release.
    k = r.randrange(mem.n_chunks)
    assert mem.keep(k * chunk + r.randrange(chunk) if k < mem.n_chunks - 1 else k * chunk)
    others = sum(mem.mapped) - 1
    end = mem.n_chunks * chunk  # the address range, the short last chunk included
    assert mem.mapped[k] and mem.unmap(0, end) == others * chunk
    assert mem.mapped == [c == k for c in range(mem.n_chunks)]
    assert not mem.releasable(0, end) and mem.unmap(0, end) == 0


def test_arena_releases_what_is_unused_and_maps_it_again(rng_seed):
    """Pages: every layer's lane keeps its first `pages` pages backed and gives back whole
    chunks above them. Slots: the range below first_slot is not backed."""
    r = random.Random(rng_seed)
    kv = KVUnit(r.randint(1, 3), 4, r.randint(1, 2), r.choice([4, 8]), torch.float32)
    slot = SlotUnit(r.choice([8, 12]), r.choice([4, 6]), torch.float32)
    lane_page = kv.layer_elems * 4  # bytes of one page in one lane
    chunk = r.choice([kv.nbytes // 2, kv.nbytes, 3 * kv.nbytes // 2])
    nbytes = 40 * kv.nbytes + 30 * slot.nbytes
    arena = ElasticArena(nbytes, "cpu", kv, slot, boundary=20 * kv.nbytes, chunk_bytes=chunk)
    lanes, kc = 2 * kv.n_layers, arena.kv_memory.chunk  # the CPU maps lanes page by page
    assert kc == lane_page and arena.slot_memory.chunk == chunk
    assert arena.kv_backed(20) and arena.slots_backed(arena.first_slot)
    assert not arena.slot_memory.is_mapped(0, arena.first_slot * slot.nbytes)
    arena.check_integrity()
    pages = r.randint(2, 10)
    before = arena.mapped_bytes
    freed = arena.release_unused(pages, arena.first_slot)

    def chunks(n_pages: int) -> int:  # chunks a lane needs for n_pages
        return -(-n_pages * lane_page // kc)

    assert freed == before - arena.mapped_bytes == lanes * (chunks(20) - chunks(pages)) * kc
    assert arena.kv_backed(pages) and (freed == 0 or not arena.kv_backed(20))
    arena.check_integrity()  # the usable slots are still backed
    assert arena.map_for(20, arena.first_slot) and arena.kv_backed(20)
    # Slots shrunk to a few: the slot range below them goes back too.
    n = r.randint(1, 5)
    arena.set_boundary(arena.boundary_for(n_slots=n))
    arena.release_unused(20, arena.first_slot)
    assert arena.slots_backed(arena.first_slot)
    sc = arena.slot_memory.chunk
    # What stays below the usable slots: the chunks under w13[0] and w2[0] (kernels check
    # the views' base pointers), nothing else.
    bases = {0, 2 * slot.inter * slot.hidden * 4 // sc}
    low = arena.first_slot * slot.nbytes // sc  # chunks wholly below the first usable slot
    assert [c for c in range(low) if arena.slot_memory.mapped[c]] == sorted(
        b for b in bases if b < low
    )
    assert arena.slot_memory.mapped_bytes <= n * slot.nbytes + (2 + len(bases)) * sc
    assert arena.kv_memory.mapped_bytes == lanes * chunks(20) * kc


@pytest.mark.gpu
def test_cuda_virtual_memory_returns_the_gap_to_the_driver(rng_seed):
    from freetoken_agent.engine.device_memory import VirtualMemory

    torch.manual_seed(rng_seed)
    dev = torch.device("cuda")
    chunk, n = 32 << 20, 24  # 768 MiB of addresses
    mem = VirtualMemory(n * chunk, dev, chunk)
    assert mem.chunk % (2 << 20) == 0
    view = mem.view()
    assert view.device.type == "cuda" and view.numel() == n * chunk
    assert mem.map(0, n * chunk)
    head, tail = torch.randn(chunk // 4, device=dev), torch.randn(chunk // 4, device=dev)
    view[:chunk].view(torch.float32).copy_(head)
    view[-chunk:].view(torch.float32).copy_(tail)
    torch.cuda.synchronize()
    free_before, _ = torch.cuda.mem_get_info()
    freed = mem.unmap(chunk, (n - 1) * chunk)
    assert freed == (n - 2) * chunk
    free_after, _ = torch.cuda.mem_get_info()
    # The driver has the memory back (other processes may move free by a little).
    assert free_after - free_before >= freed - (64 << 20), (free_before, free_after, freed)
    assert torch.equal(view[:chunk].view(torch.float32), head)  # kept chunks keep their data
    assert torch.equal(view[-chunk:].view(torch.float32), tail)
    assert mem.map(chunk, 3 * chunk)  # mapped again: usable
    view[chunk : 3 * chunk].fill_(7)
    assert bool((view[chunk : 3 * chunk] == 7).all())
    del view
    mem.close()
    torch.cuda.empty_cache()  # temporaries of the checks above sit in torch's cache
    assert torch.cuda.mem_get_info()[0] >= free_after - (64 << 20)
