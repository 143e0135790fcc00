"""The CPU's share of a layer's misses in the in-graph plan (kernels/expert_fills.py: the
plan's `post`; the MoE sum's collection of the answer, `fused_moe(collect=...)`): the twin
against the rule, the Triton kernels (interpreter here, compiled in the gpu tests) against the
twin, and the answer of a real CPU worker (kernels/cpu/worker.py) added by the MoE sum over k
exactly as the same sum adds it given as `add`.
T tokens, K top-k, H hidden, I expert width."""

import random
import time

import pytest
import torch

from freetoken_agent.kernels import reference_fills as ref
from freetoken_agent.kernels.cpu import experts, worker
from freetoken_agent.kernels.expert_fills import copy_fills, plan_fills
from freetoken_agent.kernels.fused_moe import fused_moe
from freetoken_agent.kernels.reference_fills import CpuAnswer, CpuPost, cpu_count
from freetoken_agent.kernels.triton import expert_fills as triton_fills

H, W = 48, 16  # hidden, expert width


def _cache(rng: random.Random, n_lids: int, n_slots: int):
    """A random consistent cache (some residents, free and pinned slots) and a share."""
    slot_of = torch.full((n_lids,), -1, dtype=torch.int32)
    lid_of = torch.full((n_slots,), -1, dtype=torch.int32)
    stamp = torch.full((n_slots,), -1, dtype=torch.int64)
    residents = rng.sample(range(n_lids), rng.randrange(0, min(n_lids, n_slots) + 1))
    for lid, slot in zip(residents, rng.sample(range(n_slots), len(residents)), strict=True):
        slot_of[lid], lid_of[slot], stamp[slot] = slot, lid, rng.randrange(0, 6)
    for slot in range(n_slots):
        if rng.random() < 0.15:
            stamp[slot] = ref.PINNED
    state = torch.zeros(ref.STATE, dtype=torch.int64)
    state[ref.CLOCK] = 6
    state[ref.CPU_SHARE] = rng.choice([0, ref.SHARE_ONE // 3, ref.SHARE_ONE // 2, ref.SHARE_ONE])
    state[ref.CPU_ALL_MISSES] = rng.randrange(2)  # fills pay (0) or not (1)
    return slot_of, lid_of, stamp, state


def _layer(rng: random.Random, n_experts: int, max_tokens: int, k: int = 4,
           dtype: torch.dtype = torch.bfloat16):  # fmt: skip
    """A layer's routing [T, K] (K: the mailbox's top-k), input [T, H] and weights [T, K]."""
    t = rng.randrange(1, max_tokens + 1)
    ids = torch.stack([torch.randperm(n_experts)[:k] for _ in range(t)]).to(torch.int32)
    hidden = torch.randn(t, H).to(dtype)
    weights = torch.rand(t, k)
    return ids, hidden, weights


def _slots(state, moves, pool, n_slots, device="cpu", force_triton=False):
    """Fresh slots [n_slots] with the layer's copies made (and checked)."""
    w13, w2 = pool
    slots13 = torch.zeros((n_slots, *w13.shape[1:]), dtype=w13.dtype, device=device)
    slots2 = torch.zeros((n_slots, *w2.shape[1:]), dtype=w2.dtype, device=device)
    copy_fills(state, moves, w13, w2, slots13, slots2, force_triton=force_triton)
    for lid, slot in moves[: int(state[ref.MOVES])].tolist():
        assert torch.equal(slots13[slot].cpu(), w13[lid]) and torch.equal(
            slots2[slot].cpu(), w2[lid]
        )
    return slots13, slots2


def _moe(hidden, slots, pool, rows, weights, force_triton=False, **kw):
    """The layer's MoE over the plan's rows: slots, misses read from the pool, the CPU's
    pairs (-1) skipped; `kw`: its `collect` or an `add`."""
    return fused_moe(hidden, *slots, rows.view(weights.shape), weights, host_w13=pool[0],
                     host_w2=pool[1], force_triton=force_triton, **kw)  # fmt: skip


def _pool(n_rows: int, pin: bool = False, dtype: torch.dtype = torch.bfloat16):
    w13 = torch.randn(n_rows, 2 * W, H).to(dtype)
    w2 = torch.randn(n_rows, H, W).to(dtype)
    return (w13.pin_memory(), w2.pin_memory()) if pin else (w13, w2)


def _box(max_tokens: int = 4, k: int = 4, dtype: torch.dtype = torch.bfloat16) -> worker.Mailbox:
    return worker.Mailbox.allocate(max_tokens, k, H, dtype, pin=False)


def _dtype(force_triton: bool) -> torch.dtype:
    """The MoE's dtype: bf16, but fp16 under the interpreter (which gets bf16 wrong:
    tests/kernels/test_fused_moe.py)."""
    return torch.float16 if force_triton else torch.bfloat16


def _uses(rng: random.Random, n_lids: int) -> torch.Tensor | None:
    """Popularity counts (few values: ties between misses are common), or none."""
    if rng.random() < 0.3:
        return None
    return torch.tensor([rng.randrange(3) for _ in range(n_lids)], dtype=torch.int32)


def _expected_cpu(misses: list[int], share: int, uses: torch.Tensor | None,
                  all_misses: bool) -> set[int]:  # fmt: skip
    """The rule, written apart from the twin: round(m * share) of the misses but never all of
    them unless `all_misses`, the least used (ties: the earlier; uses after this plan's
    count), or without counts the first of those miss r with round((r + 1) * share) >
    round(r * share)."""
    m = len(misses)
    n = max(0, min(int(m * share / ref.SHARE_ONE + 0.5), m if all_misses else m - 1))
    if uses is None:
        spread = [lid for r, lid in enumerate(misses)
                  if cpu_count(r + 1, share) > cpu_count(r, share)]  # fmt: skip
        return set(spread[:n])
    by_use = sorted(misses, key=lambda lid: (int(uses[lid]), misses.index(lid)))
    return set(by_use[:n])


def test_twin_gives_the_cpu_its_share_of_the_misses(rng_seed):
    rng = random.Random(rng_seed)
    torch.manual_seed(rng_seed)
    coldest = capped = lifted = 0
    for i in range(60):
        n_experts = rng.randrange(4, 9)
        slot_of, lid_of, stamp, state = _cache(rng, 2 * n_experts, rng.randrange(1, 10))
        if i % 4 == 0:  # every share in turn; a share of 1 is where the bound acts
            state[ref.CPU_SHARE] = ref.SHARE_ONE
        ids, hidden, weights = _layer(rng, n_experts, 4)
        base = n_experts * rng.randrange(2)
        lids = (ids.reshape(-1).long() + base).tolist()
        misses = [lid for lid in dict.fromkeys(lids) if int(slot_of[lid]) < 0]
        share, seq, resident_before = (
            int(state[ref.CPU_SHARE]),
            int(state[ref.SEQ]),
            slot_of.clone(),
        )
        all_misses = bool(state[ref.CPU_ALL_MISSES])
        uses = _uses(rng, 2 * n_experts)
        box = _box()
        moves = torch.zeros(16, 2, dtype=torch.int64)
        rows = plan_fills(ids, base, slot_of, lid_of, stamp, state, moves, ids.numel(),
                          CpuPost(box, hidden, weights), uses=uses)  # fmt: skip
        on_cpu = _expected_cpu(misses, share, uses, all_misses)
        coldest += uses is not None and 0 < len(on_cpu) < len(misses)
        capped += share == ref.SHARE_ONE and len(misses) > 1 and not all_misses
        lifted += share == ref.SHARE_ONE and len(misses) > 0 and all_misses
        want = round(len(misses) * share / ref.SHARE_ONE + 1e-9)
        assert len(on_cpu) == min(want, len(misses) if all_misses else max(len(misses) - 1, 0))
        assert int(state[ref.LAYER_CPU]) == len(on_cpu) == int(state[ref.CPU_EXPERTS])
        for p, lid in enumerate(lids):
            if lid in on_cpu:  # skipped by the MoE kernels, posted to the CPU, given no slot
                assert int(rows[p]) == -1 and int(box.rows[p]) == lid
                assert int(slot_of[lid]) < 0
            else:
                assert int(rows[p]) != -1
                if on_cpu:
                    assert int(box.rows[p]) == -1
        if on_cpu:
            t = hidden.shape[0]
            assert int(box.ctrl[worker.POST]) == int(state[ref.SEQ]) == seq + 1
            assert int(box.ctrl[worker.TOKENS]) == t
            assert torch.equal(box.hidden[:t], hidden)
            assert torch.equal(box.weights[: ids.numel()], weights.reshape(-1))
        else:  # nothing posted
            assert int(box.ctrl[worker.POST]) == 0 and int(state[ref.SEQ]) == seq
        fills = int(state[ref.FILLS])
        reads = int(state[ref.HOST_READS])
        assert fills + reads + len(on_cpu) == len(misses)
        assert all(int(resident_before[lid]) < 0 for lid in on_cpu)
    # a choice by counts; a share of 1 with misses to spare, bounded and not
    assert coldest and capped and lifted


@pytest.mark.parametrize("force_triton", [False, True])
def test_a_lone_miss_fills_whatever_the_share(rng_seed, force_triton):
    """A layer with one miss gives it a slot and posts nothing, even at a share of 1; with
    two misses at a share of 1 the CPU takes one, the less used (counts given)."""
    rng = random.Random(rng_seed)
    torch.manual_seed(rng_seed)
    n_experts, n_slots = 8, 12
    ids = torch.randperm(n_experts)[:4].view(1, 4).to(torch.int32)
    lids = ids.reshape(-1).long().tolist()
    for n_miss in (1, 2):
        slot_of, lid_of, stamp, state = _cache(rng, n_experts, n_slots)
        slot_of.fill_(-1)
        lid_of.fill_(-1)
        stamp.fill_(-1)  # every slot free
        resident = lids[n_miss:]  # the others hold slots
        for slot, lid in enumerate(resident):
            slot_of[lid], lid_of[slot], stamp[slot] = slot, lid, 3
        state[ref.CPU_SHARE] = ref.SHARE_ONE
        state[ref.CPU_ALL_MISSES] = 0  # fills pay: the bound holds
        uses = torch.zeros(n_experts, dtype=torch.int32)
        if n_miss == 2:
            uses[lids[0]] = rng.randrange(2, 9)  # the first miss is the more used
        box = _box(dtype=_dtype(force_triton))
        moves = torch.zeros(16, 2, dtype=torch.int64)
        hidden = torch.randn(1, H).to(_dtype(force_triton))
        rows = plan_fills(ids, 0, slot_of, lid_of, stamp, state, moves, 4,
                          CpuPost(box, hidden, torch.rand(1, 4)), uses=uses,
                          force_triton=force_triton)  # fmt: skip
        assert int(slot_of[lids[0]]) >= 0 and int(rows[0]) >= 0  # the (more used) miss filled
        if n_miss == 1:
            assert int(state[ref.CPU_EXPERTS]) == 0 and int(box.ctrl[worker.POST]) == 0
        else:  # the less used one to the CPU
            assert int(state[ref.CPU_EXPERTS]) == 1 and int(rows[1]) == -1
            assert int(box.rows[1]) == lids[1] and int(slot_of[lids[1]]) < 0


@pytest.mark.parametrize("force_triton", [False, True])
def test_where_fills_do_not_pay_the_cpu_may_take_every_miss(rng_seed, force_triton):
    """With CPU_ALL_MISSES at a share of 1, every miss of the layer goes to the CPU, a lone
    one too: nothing is filled, no slot changes, and every missed pair is posted."""
    rng = random.Random(rng_seed)
    torch.manual_seed(rng_seed)
    n_experts, n_slots = 8, 12
    ids = torch.randperm(n_experts)[:4].view(1, 4).to(torch.int32)
    lids = ids.reshape(-1).long().tolist()
    for n_miss in (1, rng.randrange(2, 5)):
        slot_of, lid_of, stamp, state = _cache(rng, n_experts, n_slots)
        slot_of.fill_(-1)
        lid_of.fill_(-1)
        stamp.fill_(-1)  # every slot free: the bound alone would fill one
        for slot, lid in enumerate(lids[n_miss:]):
            slot_of[lid], lid_of[slot], stamp[slot] = slot, lid, 3
        state[ref.CPU_SHARE], state[ref.CPU_ALL_MISSES] = ref.SHARE_ONE, 1
        tables = (slot_of.clone(), lid_of.clone())
        box = _box(dtype=_dtype(force_triton))
        moves = torch.zeros(16, 2, dtype=torch.int64)
        hidden = torch.randn(1, H).to(_dtype(force_triton))
        rows = plan_fills(ids, 0, slot_of, lid_of, stamp, state, moves, 4,
                          CpuPost(box, hidden, torch.rand(1, 4)), uses=_uses(rng, n_experts),
                          force_triton=force_triton)  # fmt: skip
        assert int(state[ref.CPU_EXPERTS]) == n_miss and int(state[ref.FILLS]) == 0
        assert torch.equal(slot_of, tables[0]) and torch.equal(lid_of, tables[1])
        assert rows[:n_miss].tolist() == [-1] * n_miss and (rows[n_miss:] >= 0).all()
        assert box.rows[:n_miss].tolist() == lids[:n_miss]
        assert int(box.ctrl[worker.POST]) == int(state[ref.SEQ]) > 0


@pytest.mark.parametrize("chunk", [None, 2])
def test_triton_plan_with_a_share_equals_the_twin(rng_seed, chunk, monkeypatch):
    if chunk:  # the scan in chunks of two slots: later chunks replace kept keys
        monkeypatch.setattr(triton_fills, "SCAN_BLOCK_MAX", chunk)
    rng = random.Random(rng_seed)
    torch.manual_seed(rng_seed)
    for _ in range(12):
        n_experts = rng.randrange(4, 9)
        a = _cache(rng, 2 * n_experts, rng.randrange(1, 10))
        b = tuple(x.clone() for x in a)
        box_a, box_b = _box(), _box()
        ma, mb = (torch.zeros(16, 2, dtype=torch.int64) for _ in range(2))
        ua = _uses(rng, 2 * n_experts)  # the popularity counts (or none), counted by both
        ub = None if ua is None else ua.clone()
        for _ in range(3):  # successive layers: the sequence numbers advance alike
            ids, hidden, weights = _layer(rng, n_experts, 4)
            base = n_experts * rng.randrange(2)
            live = rng.randrange(1, ids.numel() + 1)
            a[3][ref.LIVE_PAIRS] = b[3][ref.LIVE_PAIRS] = live
            ra = plan_fills(ids, base, *a, ma, None, CpuPost(box_a, hidden, weights), uses=ua)
            rb = plan_fills(ids, base, *b, mb, None, CpuPost(box_b, hidden, weights), uses=ub,
                            force_triton=True)  # fmt: skip
            assert torch.equal(ra, rb)
            if ua is not None:
                assert torch.equal(ua, ub)
            for x, y in zip(a, b, strict=True):
                assert torch.equal(x, y)
            n = int(a[3][ref.MOVES])
            assert torch.equal(ma[:n], mb[:n])
            for field in ("ctrl", "rows", "weights", "hidden"):
                assert torch.equal(getattr(box_a, field), getattr(box_b, field)), field


@pytest.mark.skipif(not worker.available(), reason="no SIMD expert kernel here")
@pytest.mark.parametrize("force_triton", [False, True])
def test_wait_collects_the_workers_answer(rng_seed, force_triton):
    """The MoE sum over k waits for the worker's answer to the layer's post and adds it: the
    same bits as the same MoE given the answer as `add`; a layer that posted nothing adds
    nothing."""
    rng = random.Random(rng_seed)
    torch.manual_seed(rng_seed)
    n_experts = 6
    dt = _dtype(force_triton)
    pool = _pool(2 * n_experts, dtype=dt)
    box = _box(dtype=dt)
    cpu = worker.CpuWorker(box, *pool, threads=1)
    try:
        slot_of, lid_of, stamp, state = _cache(rng, 2 * n_experts, 3)
        state[ref.CPU_SHARE] = ref.SHARE_ONE // 2
        moves = torch.zeros(16, 2, dtype=torch.int64)
        posted = 0
        for _ in range(6):
            ids, hidden, weights = _layer(rng, n_experts, 4, dtype=dt)
            base = n_experts * rng.randrange(2)
            rows = plan_fills(ids, base, slot_of, lid_of, stamp, state, moves, ids.numel(),
                              CpuPost(box, hidden, weights), force_triton=force_triton)  # fmt: skip
            slots = _slots(state, moves, pool, 3, force_triton=force_triton)
            out = _moe(hidden, slots, pool, rows, weights, force_triton,
                       collect=CpuAnswer(state, box))  # fmt: skip
            alone = _moe(hidden, slots, pool, rows, weights, force_triton)
            t, k = ids.shape
            if int(state[ref.LAYER_CPU]):
                posted += 1
                cpu_rows = box.rows[: t * k].view(t, k)
                want = experts.cpu_experts(hidden, *pool, cpu_rows, weights)  # fp32
                assert want.abs().sum() > 0
                assert torch.equal(out, _moe(hidden, slots, pool, rows, weights, force_triton,
                                             add=want))  # fmt: skip
                assert not torch.equal(out, alone)
            else:
                assert torch.equal(out, alone)  # nothing posted, nothing added
        assert int(box.ctrl[worker.JOBS]) == posted == int(state[ref.SEQ])
    finally:
        cpu.stop()


# The collect's timeout: long beside the interpreter's run on a loaded CI host (at 1 s, a sum
# that took 0.17 s alone took 0.78 s beside other tests on the 2-core box, past the margin).
TIMEOUT_S = 2.0


@pytest.mark.parametrize("force_triton", [False, True])
def test_a_wait_with_no_worker_gives_up_once(rng_seed, force_triton):
    """No thread answers: the first layer's sum marks the mailbox after its timeout and adds
    nothing; the next layer's does not wait again."""
    rng = random.Random(rng_seed)
    torch.manual_seed(rng_seed)
    dt = _dtype(force_triton)
    box = _box(dtype=dt)
    pool = _pool(8, dtype=dt)
    slot_of, lid_of, stamp, state = _cache(rng, 8, 2)
    slot_of.fill_(-1)
    lid_of.fill_(-1)  # every lid misses
    state[ref.CPU_SHARE] = ref.SHARE_ONE
    moves = torch.zeros(16, 2, dtype=torch.int64)
    for layer in range(2):
        ids, hidden, weights = _layer(rng, 4, 2, dtype=dt)
        rows = plan_fills(ids, 0, slot_of, lid_of, stamp, state, moves, ids.numel(),
                          CpuPost(box, hidden, weights), force_triton=force_triton)  # fmt: skip
        slots = _slots(state, moves, pool, 2, force_triton=force_triton)
        start = time.monotonic()
        out = _moe(hidden, slots, pool, rows, weights, force_triton,
                   collect=CpuAnswer(state, box, timeout_s=TIMEOUT_S))  # fmt: skip
        took = time.monotonic() - start
        assert int(box.ctrl[worker.TIMEOUT]) == 1  # the first post's sequence number
        assert int(box.ctrl[worker.LOST]) == layer + 1  # each lost answer's
        start = time.monotonic()
        assert torch.equal(out, _moe(hidden, slots, pool, rows, weights, force_triton))
        plain = time.monotonic() - start  # the same sum with no mailbox: no wait at all
        if layer == 0:
            assert took >= TIMEOUT_S, "the first lost answer was not waited for"
        else:  # a wait again would take TIMEOUT_S more than the plain sum; margin for load
            assert took < plain + TIMEOUT_S / 2, "a marked mailbox was waited on again"


def test_collect_refuses_an_add_beside_it_and_a_mailbox_too_small():
    box = _box(max_tokens=2, k=4)
    state = torch.zeros(ref.STATE, dtype=torch.int64)
    w13, w2 = _pool(4)
    ids = torch.zeros(3, 4, dtype=torch.int64)
    weights = torch.rand(3, 4)
    with pytest.raises(ValueError, match="mailbox answers 2 tokens"):
        fused_moe(torch.zeros(3, H), w13.float(), w2.float(), ids, weights,
                  collect=CpuAnswer(state, box))  # fmt: skip
    with pytest.raises(ValueError, match="pass it or add, not both"):
        fused_moe(torch.zeros(2, H), w13.float(), w2.float(), ids[:2], weights[:2],
                  collect=CpuAnswer(state, box), add=torch.zeros(2, H))  # fmt: skip


def test_post_refuses_a_layer_larger_than_the_mailbox():
    box = _box(max_tokens=2, k=4)
    slot_of, lid_of, stamp, state = _cache(random.Random(0), 8, 2)
    moves = torch.zeros(16, 2, dtype=torch.int64)
    for t, k in ((3, 4), (2, 2)):  # more tokens than it holds; a routing of another top-k
        ids = torch.zeros(t, k, dtype=torch.int32)
        post = CpuPost(box, torch.zeros(t, H, dtype=torch.bfloat16), torch.zeros(t, k))
        with pytest.raises(ValueError, match="mailbox holds 2 tokens of 4 pairs"):
            plan_fills(ids, 0, slot_of, lid_of, stamp, state, moves, t * k, post)


def _cuda_setup(rng: random.Random, n_experts: int, n_slots: int):
    """A CPU twin's cache and its CUDA copy, a pinned pool, a pinned mailbox and its worker."""
    cpu = _cache(rng, 2 * n_experts, n_slots)
    cpu[3][ref.CPU_SHARE] = ref.SHARE_ONE // 2
    gpu = tuple(t.cuda() for t in cpu)
    w13, w2 = _pool(2 * n_experts, pin=True)
    box = worker.Mailbox.allocate(4, 4, H, torch.bfloat16, pin=True)
    return cpu, gpu, w13, w2, box


@pytest.mark.gpu
@pytest.mark.skipif(not worker.available(), reason="no SIMD expert kernel here")
def test_gpu_plan_posts_and_the_wait_collects_the_answer(rng_seed):
    """Compiled on CUDA with a pinned mailbox: the same plans as the twin, and every layer's
    MoE adds the worker's answer for the pairs the plan posted, as the same MoE given it as
    `add` does."""
    rng = random.Random(rng_seed)
    torch.manual_seed(rng_seed)
    n_experts = 8
    cpu, gpu, w13, w2, box = _cuda_setup(rng, n_experts, 5)
    twin_box = _box()
    mc, mg = torch.zeros(16, 2, dtype=torch.int64), torch.zeros(16, 2, dtype=torch.int64).cuda()
    answer = worker.CpuWorker(box, w13, w2)
    try:
        for _ in range(40):
            ids, hidden, weights = _layer(rng, n_experts, 4)
            base = n_experts * rng.randrange(2)
            rc = plan_fills(ids, base, *cpu, mc, ids.numel(), CpuPost(twin_box, hidden, weights))
            hg, wg = hidden.cuda(), weights.cuda()
            rg = plan_fills(ids.cuda(), base, *gpu, mg, ids.numel(), CpuPost(box, hg, wg))
            slots = _slots(gpu[3], mg, (w13, w2), 5, device="cuda")
            out = _moe(hg, slots, (w13, w2), rg, wg, collect=CpuAnswer(gpu[3], box))
            assert torch.equal(rc, rg.cpu())
            for x, y in zip(cpu, gpu, strict=True):
                assert torch.equal(x, y.cpu())
            t, k = ids.shape
            rows = twin_box.rows[: t * k].view(t, k)
            add = None
            if int(cpu[3][ref.LAYER_CPU]):
                add = experts.cpu_experts(hidden, w13, w2, rows, weights).cuda()
            assert torch.equal(out, _moe(hg, slots, (w13, w2), rg, wg, add=add))
        assert int(box.ctrl[worker.TIMEOUT]) == 0
        assert int(box.ctrl[worker.JOBS]) == int(cpu[3][ref.SEQ]) > 0
    finally:
        answer.stop()


@pytest.mark.gpu
@pytest.mark.skipif(not worker.available(), reason="no SIMD expert kernel here")
def test_gpu_cpu_share_replays_in_a_captured_graph(rng_seed):
    """Plan, copies and MoE (its sum waiting for the worker) captured once, replayed over fresh
    routings: each replay's output adds the worker's answer to that replay's post, as the
    same MoE given it as `add` does (the graph holds no host decision)."""
    rng = random.Random(rng_seed)
    torch.manual_seed(rng_seed)
    n_experts, t, k = 8, 2, 4
    cpu, gpu, w13, w2, box = _cuda_setup(rng, n_experts, 5)
    twin_box = _box()
    mc, mg = torch.zeros(16, 2, dtype=torch.int64), torch.zeros(16, 2, dtype=torch.int64).cuda()
    ids_in = torch.zeros(t, k, dtype=torch.int32, device="cuda")
    hidden_in = torch.zeros(t, H, dtype=torch.bfloat16, device="cuda")
    weights_in = torch.zeros(t, k, device="cuda")
    slots13 = torch.zeros((5, *w13.shape[1:]), dtype=w13.dtype, device="cuda")
    slots2 = torch.zeros((5, *w2.shape[1:]), dtype=w2.dtype, device="cuda")
    answer = worker.CpuWorker(box, w13, w2)
    try:
        gpu[3][ref.LIVE_PAIRS] = 0  # the capture's warm-up plans nothing
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            for capture in (False, True):  # a warm-up (Triton compiles), then the capture
                if capture:
                    graph.capture_begin()
                post = CpuPost(box, hidden_in, weights_in)
                rows_g = plan_fills(ids_in, n_experts, *gpu, mg, None, post)
                copy_fills(gpu[3], mg, w13, w2, slots13, slots2)
                out_g = _moe(hidden_in, (slots13, slots2), (w13, w2), rows_g, weights_in,
                             collect=CpuAnswer(gpu[3], box))  # fmt: skip
                if capture:
                    graph.capture_end()
        torch.cuda.synchronize()
        for x, y in zip(cpu, gpu, strict=True):
            x.copy_(y.cpu())  # the warm-up's plan advanced the clock
        gpu[3][ref.LIVE_PAIRS] = t * k
        cpu[3][ref.LIVE_PAIRS] = t * k
        answered = 0
        for _ in range(30):
            ids = torch.stack([torch.randperm(n_experts)[:k] for _ in range(t)]).to(torch.int32)
            hidden = torch.randn(t, H).to(torch.bfloat16)
            weights = torch.rand(t, k)
            ids_in.copy_(ids)
            hidden_in.copy_(hidden)
            weights_in.copy_(weights)
            graph.replay()
            torch.cuda.synchronize()
            plan_fills(ids, n_experts, *cpu, mc, None, CpuPost(twin_box, hidden, weights))
            for x, y in zip(cpu, gpu, strict=True):
                assert torch.equal(x, y.cpu())
            for lid, slot in mc[: int(cpu[3][ref.MOVES])].tolist():
                assert torch.equal(slots13[slot].cpu(), w13[lid])
            add = None
            if int(cpu[3][ref.LAYER_CPU]):
                rows = twin_box.rows[: t * k].view(t, k)
                add = experts.cpu_experts(hidden, w13, w2, rows, weights).cuda()
                answered += 1
            want = _moe(hidden_in, (slots13, slots2), (w13, w2), rows_g, weights_in, add=add)
            assert torch.equal(out_g, want)
        assert answered > 0 and int(box.ctrl[worker.TIMEOUT]) == 0
    finally:
        answer.stop()


@pytest.mark.parametrize("force_triton", [False, True])
def test_a_split_plan_sends_no_whole_expert_even_uncut(rng_seed, force_triton):
    """Split tables given, the cut 0 and a share with CPU_ALL_MISSES: a split plan posts
    columns, never whole experts, so every miss fills (the twin gated the share on the cut,
    the Triton plan on the tables; both on the tables now)."""
    rng = random.Random(rng_seed)
    n_experts, n_slots = 8, rng.randrange(4, 9)
    slot_of = torch.full((n_experts,), -1, dtype=torch.int32)
    lid_of = torch.full((n_slots,), -1, dtype=torch.int32)
    stamp = torch.full((n_slots,), -1, dtype=torch.int64)
    state = torch.zeros(ref.STATE, dtype=torch.int64)
    state[ref.CLOCK] = 6
    state[ref.CPU_SHARE], state[ref.CPU_ALL_MISSES] = rng.randrange(1, ref.SHARE_ONE + 1), 1
    split = ref.SplitTables(torch.full((n_slots,), W, dtype=torch.int32),
                            torch.full((n_slots,), -1, dtype=torch.int64), W)  # fmt: skip
    box = _box(dtype=_dtype(force_triton))
    k = 4  # the mailbox's top-k
    ids = torch.randperm(n_experts)[:k].view(1, k).to(torch.int32)
    post = CpuPost(box, torch.randn(1, H).to(_dtype(force_triton)), torch.rand(1, k))
    moves = torch.zeros(16, 2, dtype=torch.int64)
    rows = plan_fills(ids, 0, slot_of, lid_of, stamp, state, moves, k, post, split=split,
                      force_triton=force_triton)  # fmt: skip
    assert int(state[ref.CPU_EXPERTS]) == 0 and int(state[ref.FILLS]) == k
    assert (rows >= 0).all()  # (the split plan's own post at cut 0 is no state the engine runs)
