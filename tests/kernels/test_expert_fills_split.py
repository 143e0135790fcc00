"""The split expert in the in-graph plan and copies (kernels/reference_fills.py's docstring):
the twin against the rule, the Triton kernels (interpreter here) against the twin, the copies
of a cut slot's columns, and a layer computed from a cut slot plus the CPU worker's columns
against the whole expert. T tokens, K top-k, H hidden, W the expert width (I)."""

import random

import pytest
import torch
from sm90_compile import compiled_json

from freetoken_agent.kernels import reference_fills as ref
from freetoken_agent.kernels.cpu import worker
from freetoken_agent.kernels.expert_fills import copy_fills, plan_fills
from freetoken_agent.kernels.reference_fills import CpuPost, SplitTables
from freetoken_agent.kernels.triton import expert_fills as triton_fills

H, W = 48, 16
K = 4


def _cache(rng: random.Random, n_lids: int, n_slots: int, cut: int):
    """A random consistent cache whose residents are whole, cut and landed, or cut and in
    flight; a CPU share the split plan must ignore."""
    slot_of = torch.full((n_lids,), -1, dtype=torch.int32)
    lid_of = torch.full((n_slots,), -1, dtype=torch.int32)
    stamp = torch.full((n_slots,), -1, dtype=torch.int64)
    cols = torch.full((n_slots,), W, dtype=torch.int32)
    landed = torch.full((n_slots,), -1, dtype=torch.int64)
    residents = rng.sample(range(n_lids), rng.randrange(0, min(n_lids, n_slots) + 1))
    for lid, slot in zip(residents, rng.sample(range(n_slots), len(residents)), strict=True):
        slot_of[lid], lid_of[slot], stamp[slot] = slot, lid, rng.randrange(0, 6)
        kind = rng.choice(["whole", "landed", "flight", "flight-stale"])
        if kind != "whole":
            cols[slot] = cut
        landed[slot] = {"landed": lid, "flight": -1}.get(kind, rng.randrange(n_lids))
        if kind == "flight-stale" and landed[slot] == lid:
            landed[slot] = -1
    for slot in range(n_slots):
        if rng.random() < 0.1:
            stamp[slot] = ref.PINNED
    state = torch.zeros(ref.STATE, dtype=torch.int64)
    state[ref.CLOCK] = 6
    state[ref.CPU_SHARE] = rng.choice([0, ref.SHARE_ONE // 2, ref.SHARE_ONE])
    state[ref.SPLIT_COLS] = cut
    return (slot_of, lid_of, stamp, state), SplitTables(cols, landed, W)


def _layer(rng: random.Random, n_experts: int, max_tokens: int = 4):
    t = rng.randrange(1, max_tokens + 1)
    ids = torch.stack([torch.randperm(n_experts)[:K] for _ in range(t)]).to(torch.int32)
    return ids, torch.randn(t, H).to(torch.bfloat16), torch.rand(t, K)


def _box(max_tokens: int = 4) -> worker.Mailbox:
    return worker.Mailbox.allocate(max_tokens, K, H, torch.bfloat16, pin=False)


def _clone(cache, split: SplitTables):
    return tuple(x.clone() for x in cache), SplitTables(split.cols.clone(), split.landed.clone(), W)


def test_twin_cuts_every_fill_and_posts_its_columns_and_the_hits_in_flight(rng_seed):
    rng = random.Random(rng_seed)
    torch.manual_seed(rng_seed)
    for _ in range(40):
        n_experts, cut = rng.randrange(4, 9), rng.randrange(1, W)
        cache, split = _cache(rng, 2 * n_experts, rng.randrange(1, 10), cut)
        slot_of, lid_of, stamp, state = cache
        ids, hidden, weights = _layer(rng, n_experts)
        base = n_experts * rng.randrange(2)
        lids = (ids.reshape(-1).long() + base).tolist()
        before_slot, before_cols = slot_of.clone(), split.cols.clone()
        before_landed, in_flight = split.landed.clone(), split.in_flight(lid_of).clone()
        before = state.clone()
        box, moves = _box(), torch.zeros(16, 2, dtype=torch.int64)
        rows = plan_fills(ids, base, *cache, moves, ids.numel(), CpuPost(box, hidden, weights),
                          split=split)  # fmt: skip
        fills = {lid: slot for lid, slot in moves[: int(state[ref.MOVES])].tolist()}
        partial = set()
        for lid in dict.fromkeys(lids):
            s = int(before_slot[lid])
            if s < 0 or int(before_cols[s]) == W:
                continue
            if int(before_landed[s]) == lid:
                assert int(split.cols[s]) == W  # landed: whole from now on
            else:
                partial.add(lid)
                assert int(split.cols[s]) == cut
        for lid, slot in fills.items():
            assert not bool(in_flight[slot])  # copies on their way never lose their slot
            assert int(split.cols[slot]) == cut and int(split.landed[slot]) == -1
            assert int(slot_of[lid]) == slot
        posted = set(fills) | partial
        firsts = {}
        for p, lid in enumerate(lids):
            assert int(rows[p]) == (int(slot_of[lid]) if int(slot_of[lid]) >= 0 else -lid - 2)
            first = firsts.setdefault(lid, p) == p
            if posted:  # (nothing posted: the mailbox as it was)
                assert int(box.rows[p]) == (lid if lid in posted else -1)
                want_fill = fills[lid] if (first and lid in fills) else -1
                assert int(box.fill_slots[p]) == want_fill
        assert int(state[ref.LAYER_CPU]) == len(posted)
        assert int(state[ref.SPLITS]) - int(before[ref.SPLITS]) == len(fills)
        assert int(state[ref.PARTIAL_HITS]) - int(before[ref.PARTIAL_HITS]) == len(partial)
        assert int(state[ref.CPU_EXPERTS]) == 0  # no whole experts to the CPU
        if posted:
            assert int(box.ctrl[worker.POST]) == int(state[ref.SEQ]) == 1
            assert (int(box.ctrl[worker.COL_LO]), int(box.ctrl[worker.COL_HI])) == (cut, W)
        else:
            assert int(box.ctrl[worker.POST]) == 0 and int(state[ref.SEQ]) == 0


def test_a_slot_in_flight_is_never_a_victim():
    """Two slots: the older is in flight, so the miss takes the newer; with both in flight
    the miss stays on the host."""
    slot_of = torch.tensor([0, 1, -1], dtype=torch.int32)
    lid_of = torch.tensor([0, 1], dtype=torch.int32)
    for landed_1, victim in ((-1, None), (1, 1)):
        stamp = torch.tensor([0, 1], dtype=torch.int64)
        state = torch.zeros(ref.STATE, dtype=torch.int64)
        state[ref.CLOCK], state[ref.SPLIT_COLS] = 4, 8
        split = SplitTables(torch.tensor([8, 8], dtype=torch.int32),
                            torch.tensor([-1, landed_1], dtype=torch.int64), W)  # fmt: skip
        ids = torch.tensor([[2]], dtype=torch.int32)
        box = worker.Mailbox.allocate(1, 1, H, torch.bfloat16, pin=False)
        moves = torch.zeros(4, 2, dtype=torch.int64)
        post = CpuPost(box, torch.randn(1, H).to(torch.bfloat16), torch.rand(1, 1))
        rows = plan_fills(ids, 0, slot_of.clone(), lid_of.clone(), stamp, state, moves, 1, post,
                          split=split)  # fmt: skip
        if victim is None:
            assert int(state[ref.MOVES]) == 0 and int(rows[0]) == -2 - 2
            assert int(state[ref.HOST_READS]) == 1
        else:
            assert moves[0].tolist() == [2, victim] and int(rows[0]) == victim


@pytest.mark.parametrize("chunk", [None, 2])
def test_triton_split_plan_equals_the_twin(rng_seed, chunk, monkeypatch):
    if chunk:  # the scan in chunks of two slots: later chunks replace kept keys
        monkeypatch.setattr(triton_fills, "SCAN_BLOCK_MAX", chunk)
    rng = random.Random(rng_seed)
    torch.manual_seed(rng_seed)
    for _ in range(8):
        n_experts, cut = rng.randrange(4, 9), rng.randrange(1, W)
        a, sa = _cache(rng, 2 * n_experts, rng.randrange(1, 10), cut)
        b, sb = _clone(a, sa)
        box_a, box_b = _box(), _box()
        ma, mb = (torch.zeros(16, 2, dtype=torch.int64) for _ in range(2))
        for _ in range(3):  # successive layers; some copies behind land between them
            ids, hidden, weights = _layer(rng, n_experts)
            base = n_experts * rng.randrange(2)
            live = rng.randrange(1, ids.numel() + 1)
            a[3][ref.LIVE_PAIRS] = b[3][ref.LIVE_PAIRS] = live
            ra = plan_fills(ids, base, *a, ma, None, CpuPost(box_a, hidden, weights), split=sa)
            rb = plan_fills(ids, base, *b, mb, None, CpuPost(box_b, hidden, weights), split=sb,
                            force_triton=True)  # fmt: skip
            assert torch.equal(ra, rb)
            for x, y in zip((*a, sa.cols, sa.landed), (*b, sb.cols, sb.landed), strict=True):
                assert torch.equal(x, y)
            n = int(a[3][ref.MOVES])
            assert torch.equal(ma[:n], mb[:n])
            for field in ("ctrl", "rows", "fill_slots", "weights", "hidden"):
                assert torch.equal(getattr(box_a, field), getattr(box_b, field)), field
            for slot in range(sa.cols.numel()):
                if rng.random() < 0.5 and int(a[1][slot]) >= 0:
                    sa.landed[slot] = sb.landed[slot] = int(a[1][slot])


@pytest.mark.parametrize("force_triton", [False, True])
@pytest.mark.parametrize("aligned", [False, True])
@pytest.mark.parametrize("hidden, width", [(H, W), (160, 144)])
def test_split_copies_move_only_the_columns_before_the_cut(rng_seed, force_triton, aligned,
                                                           hidden, width):  # fmt: skip
    """(160, 144): w13's halves span several copy chunks and w2's columns several tiles of
    the Triton kernel (64 rows x 128 columns), each cut short by its masks; `aligned`: a cut
    on a multiple of 8 (the vectorised branch) or off it."""
    rng = random.Random(rng_seed)
    torch.manual_seed(rng_seed)
    n_rows, n_slots = 6, 4
    # The wide case cuts past the first 128-column tile, so w2's second tile runs masked.
    first = 129 if width > 128 else 1
    cut = rng.randrange(-(-first // 8), width // 8) * 8 if aligned else rng.randrange(first, width)
    cut += 1 if not aligned and cut % 8 == 0 else 0
    w13, w2 = torch.randn(n_rows, 2 * width, hidden), torch.randn(n_rows, hidden, width)
    slots13 = torch.randn(n_slots, 2 * width, hidden)
    slots2 = torch.randn(n_slots, hidden, width)
    want13, want2 = slots13.clone(), slots2.clone()
    state = torch.zeros(ref.STATE, dtype=torch.int64)
    pairs = list(zip(rng.sample(range(n_rows), 3), rng.sample(range(n_slots), 3), strict=True))
    moves = torch.tensor(pairs + [(0, 0)], dtype=torch.int64)
    state[ref.MOVES], state[ref.SPLIT_COLS] = 3, cut
    for lid, slot in pairs:
        want13[slot, :cut] = w13[lid, :cut]
        want13[slot, width : width + cut] = w13[lid, width : width + cut]
        want2[slot, :, :cut] = w2[lid, :, :cut]
    copy_fills(state, moves, w13, w2, slots13, slots2, split=True, force_triton=force_triton)
    assert torch.equal(slots13, want13) and torch.equal(slots2, want2)


def test_split_plan_refuses_bad_tables():
    cache, split = _cache(random.Random(0), 8, 4, 8)
    ids, hidden, weights = _layer(random.Random(1), 4)
    post = CpuPost(_box(), hidden, weights)
    moves = torch.zeros(16, 2, dtype=torch.int64)
    bad_cols = SplitTables(split.cols.long(), split.landed, W)
    with pytest.raises(ValueError, match="split.cols"):
        plan_fills(ids, 0, *cache, moves, None, post, split=bad_cols)
    bad_landed = SplitTables(split.cols, split.landed[:2], W)
    with pytest.raises(ValueError, match="split.landed"):
        plan_fills(ids, 0, *cache, moves, None, post, split=bad_landed)
    with pytest.raises(ValueError, match="needs `post`"):
        plan_fills(ids, 0, *cache, moves, None, None, split=split)


# Compiles the split plan and copies for sm_90 (no GPU needed) in a process of its own (this
# one imported the kernels under the interpreter): the split's tables are read and written.
_COMPILE_SPLIT = """
import json, re
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from freetoken_agent.kernels.triton.expert_fills import _copy_kernel, _plan_kernel
ptr = dict(ids_ptr="*i32", rows_ptr="*i64", slot_of="*i32", lid_of="*i32", stamp="*i64",
           state="*i64", moves="*i64", box_ctrl="*i64", box_rows="*i64", box_weights="*fp32",
           box_hidden="*bf16", hidden="*bf16", weights="*fp32", uses="*i32", box_fills="*i64",
           cols="*i32", landed="*i64", src13="*bf16", src2="*bf16", dst13="*bf16",
           dst2="*bf16", box_out="*fp32", add="*fp32", base="i64", timeout="i64")
# The ints and pointers the launch specialises as multiples of 16 at 48 layers' shapes.
div16 = {"src13", "src2", "dst13", "dst2", "s_stride13", "s_stride2", "d_stride13",
         "d_stride2", "n13", "n2", "width", "hidden_size"}
out = {}
for split in (False, True):
    plan = dict(LIMITED=True, BLOCK_P=16, BLOCK_S=1024, SHARE=True, SYS=True, BLOCK_H=1024,
                COUNT=False, THROUGH=False, SPLIT=split, PDL=0)
    copy = dict(PROGRAMS=32, BLOCK=8192, SPLIT=split, BLOCK_C=128, PDL=0)
    for kernel, consts in ((_plan_kernel, plan), (_copy_kernel, copy)):
        names = kernel.arg_names
        sig = {n: "constexpr" if n in consts else ptr.get(n, "i32") for n in names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in div16}
        ptx = compile(ASTSource(kernel, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                      options=dict(num_warps=4)).asm["ptx"]
        out[f"{kernel.fn.__name__}:{split}"] = len(re.findall(r"ld\\.global", ptx))
        out[f"{kernel.fn.__name__}:{split}:v4"] = len(re.findall(r"ld\\.global\\.v4", ptx))
print(json.dumps(out))
"""


def test_the_split_kernels_compile_for_sm90_and_read_more():
    loads = compiled_json(_COMPILE_SPLIT)
    # the plan reads the tables (cols, landed, the scan's three) and the copy the cut
    assert loads["_plan_kernel:True"] > loads["_plan_kernel:False"], loads
    assert loads["_copy_kernel:True"] > loads["_copy_kernel:False"], loads
    # The cut copies load 16 bytes at a time as whole fills do, in both w13's halves and w2's
    # column tiles (an address gathered by division compiled to 2-byte loads only, and the
    # split fills crossed the link at about half its rate on the H200).
    assert loads["_copy_kernel:False:v4"] >= 2, loads
    assert loads["_copy_kernel:True:v4"] >= loads["_copy_kernel:False:v4"], loads
