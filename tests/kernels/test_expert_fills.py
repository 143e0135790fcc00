"""The in-graph cache fill (kernels/expert_fills.py): the torch twin against a plain-Python LRU
model of the plan's rule, the Triton kernels (interpreter here, compiled in the gpu test) against
the twin, bit for bit, over random sequences of layer visits."""

import random

import pytest
import torch
from sm90_compile import compiled_json

from freetoken_agent.kernels import reference_fills as ref
from freetoken_agent.kernels.expert_fills import copy_fills, plan_fills
from freetoken_agent.kernels.triton import expert_fills as triton_fills


def _state(rng: random.Random, n_lids: int, n_slots: int, device="cpu"):
    """A random consistent cache: some slots pinned, some free, residents with random
    (distinct or tied) stamps below the clock."""
    slot_of = torch.full((n_lids,), -1, dtype=torch.int32)
    lid_of = torch.full((n_slots,), -1, dtype=torch.int32)
    stamp = torch.full((n_slots,), -1, dtype=torch.int64)
    residents = rng.sample(range(n_lids), rng.randrange(0, min(n_lids, n_slots) + 1))
    slots = rng.sample(range(n_slots), len(residents))
    for lid, slot in zip(residents, slots, strict=True):
        slot_of[lid], lid_of[slot] = slot, lid
        stamp[slot] = rng.randrange(0, 6)
    for slot in range(n_slots):
        if rng.random() < 0.15:
            stamp[slot] = ref.PINNED  # a kept layer's resident, or a slot out of service
    state = torch.zeros(ref.STATE, dtype=torch.int64)
    state[ref.CLOCK] = 6
    tensors = (slot_of, lid_of, stamp, state)
    return tuple(t.to(device) for t in tensors)


def _model_plan(lids: list[int], slot_of: list[int], lid_of: list[int], stamp: list[int],
                clock: int) -> tuple[list[int], list[tuple[int, int]]]:  # fmt: skip
    """The plan's rule in plain Python, on lists (mutated): returns (rows, moves)."""
    uniq = list(dict.fromkeys(lids))
    for lid in uniq:
        if slot_of[lid] >= 0 and stamp[slot_of[lid]] != ref.PINNED:
            stamp[slot_of[lid]] = clock
    moves = []
    for lid in [lid for lid in uniq if slot_of[lid] < 0]:
        free = [(stamp[s], s) for s in range(len(stamp)) if stamp[s] < clock]
        if not free:
            break
        _, slot = min(free)
        if lid_of[slot] >= 0:
            slot_of[lid_of[slot]] = -1
        lid_of[slot], slot_of[lid], stamp[slot] = lid, slot, clock
        moves.append((lid, slot))
    rows = [slot_of[lid] if slot_of[lid] >= 0 else -lid - 2 for lid in lids]
    return rows, moves


def _visits(rng: random.Random, n_layers: int, n_experts: int, steps: int):
    for _ in range(steps):
        t, k = rng.randrange(1, 5), rng.randrange(1, min(n_experts, 4) + 1)
        layer = rng.randrange(n_layers)
        ids = torch.stack([torch.randperm(n_experts)[:k] for _ in range(t)]).to(torch.int32)
        if rng.random() < 0.3:  # a skewed layer: tokens share experts
            ids = ids % max(1, n_experts // 3)
        yield layer, ids


def test_twin_follows_the_lru_rule(rng_seed):
    rng = random.Random(rng_seed)
    torch.manual_seed(rng_seed)
    for _ in range(4):
        n_layers, n_experts = rng.randrange(1, 4), rng.randrange(2, 9)
        slot_of, lid_of, stamp, state = _state(rng, n_layers * n_experts, rng.randrange(1, 13))
        model = [slot_of.tolist(), lid_of.tolist(), stamp.tolist()]
        moves = torch.zeros(16, 2, dtype=torch.int64)
        for layer, ids in _visits(rng, n_layers, n_experts, 25):
            clock = int(state[ref.CLOCK]) + 1
            lids = (ids.reshape(-1).long() + layer * n_experts).tolist()
            rows = plan_fills(ids, layer * n_experts, slot_of, lid_of, stamp, state, moves,
                              live_pairs=ids.numel())  # fmt: skip
            want_rows, want_moves = _model_plan(lids, *model, clock)
            assert rows.tolist() == want_rows
            assert [slot_of.tolist(), lid_of.tolist(), stamp.tolist()] == model
            assert moves[: int(state[ref.MOVES])].tolist() == [list(m) for m in want_moves]
            # slot_of and lid_of stay inverse; pinned slots keep their stamp
            for lid, slot in enumerate(slot_of.tolist()):
                assert slot < 0 or lid_of[slot] == lid
        assert int(state[ref.FILLS]) + int(state[ref.HOST_READS]) + int(state[ref.HITS]) == int(
            state[ref.EXPERTS]
        )


def _run_both(rng, n_lids_layers, n_slots, steps, live_from_state):
    n_layers, n_experts = n_lids_layers
    a = _state(rng, n_layers * n_experts, n_slots)
    b = tuple(t.clone() for t in a)
    ma, mb = (torch.zeros(16, 2, dtype=torch.int64) for _ in range(2))
    # The popularity counts (popular_pins.py), from random starting values; every other run
    # counts none, as an engine without the pins.
    count = rng.random() < 0.5
    through = rng.random() < 0.5  # fill-through: moved lids keep their host ids in the rows
    ua = torch.randint(0, 50, (n_layers * n_experts,), dtype=torch.int32) if count else None
    ub = ua.clone() if count else None
    want = ua.clone() if count else None
    for layer, ids in _visits(rng, n_layers, n_experts, steps):
        base = layer * n_experts
        if live_from_state:  # a captured graph: padded rows past the step's real pairs
            live = rng.randrange(1, ids.numel() + 1)
            a[3][ref.LIVE_PAIRS] = b[3][ref.LIVE_PAIRS] = live
            ra = plan_fills(ids, base, *a, ma, uses=ua, through=through)
            rb = plan_fills(ids, base, *b, mb, uses=ub, through=through, force_triton=True)
            assert rb[live:].eq(-1).all()
        else:
            live = ids.numel()
            ra = plan_fills(ids, base, *a, ma, live_pairs=live, uses=ua, through=through)
            rb = plan_fills(ids, base, *b, mb, live_pairs=live, uses=ub, through=through,
                            force_triton=True)  # fmt: skip
        assert torch.equal(ra, rb)
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y)
        n = int(a[3][ref.MOVES])
        assert torch.equal(ma[:n], mb[:n])
        lids = ids.reshape(-1)[:live].long() + base
        for lid, slot in ma[:n].tolist():  # a moved lid: its slot now, or read from the host
            row = -lid - 2 if through else slot
            assert (ra[:live][lids == lid] == row).all(), (through, lid, slot)
        if through:  # every other pair's row is the plain plan's: hits read their slots
            moved = torch.isin(lids, ma[:n, 0])
            slots = a[0][lids].long()  # the table after the plan
            assert torch.equal(ra[:live], torch.where(moved | (slots < 0), -lids - 2, slots))
        if count:  # each distinct lid of the live pairs: one use, in both
            want[torch.unique(ids.reshape(-1)[:live].long()) + base] += 1
            assert torch.equal(ua, want) and torch.equal(ub, want)


@pytest.mark.parametrize("live_from_state", [False, True])
def test_triton_plan_equals_the_twin(rng_seed, live_from_state):
    rng = random.Random(rng_seed)
    torch.manual_seed(rng_seed)
    for _ in range(2):
        shape = (rng.randrange(1, 4), rng.randrange(2, 9))
        _run_both(rng, shape, rng.randrange(1, 13), 12, live_from_state)


def test_triton_plan_scans_past_one_block(rng_seed):
    """More slots than one scan chunk holds (4096): the smallest stamps may sit in a later
    chunk."""
    rng = random.Random(rng_seed)
    torch.manual_seed(rng_seed)
    _run_both(rng, (3, 2000), 5000, 4, False)


@pytest.mark.parametrize("chunk", [4, 64])
def test_triton_plan_in_small_chunks_equals_the_twin(rng_seed, chunk, monkeypatch):
    """The scan in many chunks: a later chunk's keys replace the worst kept ones or come in
    below them, and the kept keys are sorted before the fills take them in order."""
    monkeypatch.setattr(triton_fills, "SCAN_BLOCK_MAX", chunk)
    rng = random.Random(rng_seed)
    torch.manual_seed(rng_seed)
    for _ in range(2):
        _run_both(rng, (rng.randrange(2, 4), rng.randrange(8, 17)), rng.randrange(9, 300), 8,
                  rng.random() < 0.5)  # fmt: skip


@pytest.mark.parametrize("force_triton, programs", [(False, 32), (True, 32), (True, None)])
def test_copies_move_the_planned_rows(rng_seed, force_triton, programs):
    """Every planned row lands in its slot and nothing else changes, whatever grid the
    calibration chose (None: a random one, smaller than the chunks to copy too)."""
    rng = random.Random(rng_seed)
    programs = programs or rng.randrange(1, 8)
    torch.manual_seed(rng_seed)
    n_lids, n_slots, i, h = 12, 5, rng.randrange(1, 40), rng.randrange(1, 40)
    pool13, pool2 = torch.randn(n_lids, 2 * i, h), torch.randn(n_lids, h, i)
    # Slot rows strided apart, as the elastic arena's views are
    unit = 3 * i * h + rng.randrange(0, 9)
    flat = torch.randn(n_slots * unit)
    slot13 = flat.as_strided((n_slots, 2 * i, h), (unit, h, 1))
    slot2 = flat.as_strided((n_slots, h, i), (unit, i, 1), 2 * i * h)
    state = torch.zeros(ref.STATE, dtype=torch.int64)
    moves = torch.zeros(8, 2, dtype=torch.int64)
    n = rng.randrange(0, n_slots + 1)
    lids, slots = rng.sample(range(n_lids), n), rng.sample(range(n_slots), n)
    moves[:n] = torch.tensor(list(zip(lids, slots, strict=True)), dtype=torch.int64).view(n, 2)
    state[ref.MOVES] = n
    untouched = [s for s in range(n_slots) if s not in slots]
    before = flat.clone()
    copy_fills(state, moves, pool13, pool2, slot13, slot2, programs=programs,
               force_triton=force_triton)  # fmt: skip
    for lid, slot in zip(lids, slots, strict=True):
        assert torch.equal(slot13[slot], pool13[lid]) and torch.equal(slot2[slot], pool2[lid])
    for s in untouched:
        assert torch.equal(flat[s * unit : (s + 1) * unit], before[s * unit : (s + 1) * unit])


@pytest.mark.parametrize("programs", [0, -3, True, 2.0])
def test_copies_refuse_a_grid_that_is_no_positive_count(programs):
    t = torch.zeros(2, 4, 4)
    with pytest.raises(ValueError, match="programs must be a positive integer"):
        copy_fills(torch.zeros(ref.STATE, dtype=torch.int64), torch.zeros(2, 2, dtype=torch.int64),
                   t, t, t, t, programs=programs)  # fmt: skip


def test_plan_refuses_too_few_moves():
    t = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(ValueError, match="moves holds 2 fills"):
        plan_fills(torch.zeros(3, dtype=torch.int32), 0, t, t, t.long(), t.long(),
                   torch.zeros(2, 2, dtype=torch.int64))  # fmt: skip


@pytest.mark.gpu
def test_gpu_plan_and_copies_equal_the_twin(rng_seed):
    """Compiled on CUDA, the pool pinned (read over the link): the same state as the CPU twin,
    and the slots hold the pool's rows after the copies."""
    rng = random.Random(rng_seed)
    torch.manual_seed(rng_seed)
    n_layers, n_experts, n_slots, i, h = 4, 64, 1500, 96, 128
    cpu = _state(rng, n_layers * n_experts, n_slots)
    gpu = tuple(t.cuda() for t in cpu)
    pool13 = torch.randn(n_layers * n_experts, 2 * i, h).to(torch.bfloat16).pin_memory()
    pool2 = torch.randn(n_layers * n_experts, h, i).to(torch.bfloat16).pin_memory()
    slot13 = torch.zeros(n_slots, 2 * i, h, dtype=torch.bfloat16, device="cuda")
    slot2 = torch.zeros(n_slots, h, i, dtype=torch.bfloat16, device="cuda")
    mc, mg = torch.zeros(32, 2, dtype=torch.int64), torch.zeros(32, 2, dtype=torch.int64).cuda()
    landed: dict[int, int] = {}  # lid -> slot of every fill
    for layer, ids in _visits(rng, n_layers, n_experts, 40):
        base = layer * n_experts
        rc = plan_fills(ids, base, *cpu, mc, live_pairs=ids.numel())
        rg = plan_fills(ids.cuda(), base, *gpu, mg, live_pairs=ids.numel())
        copy_fills(gpu[3], mg, pool13, pool2, slot13, slot2)
        assert torch.equal(rc, rg.cpu())
        for x, y in zip(cpu, gpu, strict=True):
            assert torch.equal(x, y.cpu())
        landed.update(dict(mc[: int(cpu[3][ref.MOVES])].tolist()))
    torch.cuda.synchronize()
    kept = [(lid, slot) for lid, slot in landed.items() if int(cpu[0][lid]) == slot]
    assert kept
    for lid, slot in kept:  # every fill still in its slot holds the pool's rows
        assert torch.equal(slot13[slot].cpu(), pool13[lid])
        assert torch.equal(slot2[slot].cpu(), pool2[lid])


# Compiles the plan kernel for sm_90 (no GPU needed) with and without the use counts, in a
# process of its own (this one imported the kernels under the interpreter).
_COMPILE_PLAN = """
import json, re
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from freetoken_agent.kernels.triton.expert_fills import _plan_kernel
types = dict(ids_ptr="*i32", rows_ptr="*i64", slot_of="*i32", lid_of="*i32", stamp="*i64",
             state="*i64", moves="*i64", base="i64", box_ctrl="*i64", box_rows="*i64",
             box_weights="*fp32", box_hidden="*bf16", hidden="*bf16", weights="*fp32",
             uses="*i32", box_fills="*i64", cols="*i32", landed="*i64", width="i32")
out = {}
for count in (False, True):
    consts = dict(LIMITED=True, BLOCK_P=16, BLOCK_S=1024, SHARE=False, SYS=True, BLOCK_H=1024,
                  COUNT=count, THROUGH=False, SPLIT=False, PDL=0)
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in _plan_kernel.arg_names}
    ptx = compile(ASTSource(_plan_kernel, sig, consts), target=GPUTarget("cuda", 90, 32),
                  options=dict(num_warps=4)).asm["ptx"]
    out[str(count)] = [len(re.findall(r"ld\\.global", ptx)), len(re.findall(r"st\\.global", ptx))]
print(json.dumps(out))
"""


def test_the_counting_plan_compiles_for_sm90_with_one_load_and_one_store_more():
    counts = compiled_json(_COMPILE_PLAN)
    (loads, stores), (loads_c, stores_c) = counts["False"], counts["True"]
    assert (loads_c, stores_c) == (loads + 1, stores + 1), counts
