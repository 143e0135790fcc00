"""Elastic memory on the CPU with a simulated GPU budget: KV pages and expert slots share one
arena whose split moves at safe points, with outputs unchanged and every pool intact."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from tiny_models import make_tiny

from freetoken_agent import Engine, SamplingParams
from freetoken_agent.bench.simulated_device import SimulatedDevice
from freetoken_agent.engine.experts.placement import workspace_bytes
from freetoken_agent.engine.kv.pool import KVPool
from freetoken_agent.engine.kv.recurrence import recurrent_device_bytes
from freetoken_agent.engine.loading import dense_nbytes
from freetoken_agent.engine.outputs import InvalidRequestError
from freetoken_agent.kernels.reference_fills import PINNED

SP = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture
def model(tmp_path, rng_seed):
    make_tiny("qwen3_moe", tmp_path, rng_seed, max_position_embeddings=2048)
    resident = Engine.load(tmp_path, device="cpu", progress=False, policy="resident")
    return tmp_path, resident, random.Random(rng_seed)


def _elastic(path, resident: Engine, slots: int, kv_tokens: int = 256,
             policy: str = "transfer", lend: bool = True) -> Engine:  # fmt: skip
    """An engine whose budget holds the dense weights, the workspace, `kv_tokens` of KV and
    `slots` expert slots; the split moves in groups of 4 slots. `lend`: the workspace a
    decode step cannot need is lent to slots (EngineConfig.lend_workspace). A tiny model's
    lent workspace is ~10x its whole split, so a cut within the floor never moves the split
    while it decodes: the tests of a cut's arithmetic keep the workspace whole."""
    spec, config = resident.spec, resident.config
    dense = dense_nbytes(resident.loaded.model)
    kv_unit = 2 * len(spec.attention_layers) * 16 * spec.n_kv_heads * spec.head_dim * 4
    budget = (
        dense
        + workspace_bytes(spec, config, offloaded=True)
        + (kv_tokens // 16 + 1) * kv_unit
        + (slots + 1) * spec.expert_bytes
    )
    engine = Engine.load(
        path, device="cpu", progress=False, policy=policy, gpu_budget=budget,
        kv_tokens=kv_tokens, elastic_group_bytes=4 * spec.expert_bytes, max_model_len=2048,
        lend_workspace=lend,
    )  # fmt: skip
    assert engine.memory is not None
    return engine


def _staged_budget(resident: Engine, slots: int, kv_tokens: int) -> int:
    """Dense weights, workspace, `kv_tokens` of fp32 KV, `slots` slots and two layers of
    staging buffers of their own (a budget too small to lend them from slots)."""
    spec = resident.spec
    kv_page = 2 * 16 * spec.n_layers * spec.n_kv_heads * spec.head_dim * 4
    return (
        dense_nbytes(resident.loaded.model)
        + workspace_bytes(spec, resident.config, offloaded=True)
        + slots * spec.expert_bytes
        + (kv_tokens // 16 + 1) * kv_page
        + 2 * spec.n_experts * spec.expert_bytes
    )


def _run(engine: Engine, prompt: list[int], on_step=None) -> list[int]:
    rid = engine.submit(prompt, SP)
    n = 0
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
        n += 1
        if on_step is not None:
            on_step(n)
    return engine._collect(rid).token_ids


def test_growing_context_moves_slots_to_pages_and_back(model):
    path, resident, rng = model
    engine = _elastic(path, resident, slots=40)
    first = engine.memory.stats()
    history = [rng.randrange(3, 320) for _ in range(60)]
    pages, slots, needed = [], [], []
    for _ in range(5):  # an agent session: each turn adds to the context (to ~510 tokens)
        history += [rng.randrange(3, 320) for _ in range(rng.randrange(80, 90))]
        assert _run(engine, history) == resident.generate(history, SP).token_ids
        st = engine.memory.stats()
        pages.append(st["kv_pages"])
        slots.append(st["slots"])
        needed.append(-(-(len(history) + SP.max_tokens) // 16) + 1)  # + the scratch page
    assert pages[-1] > first["kv_pages"] and slots[-1] < first["slots"]
    # Pages follow the context (between turns free pages may go back to slots, so the
    # counts need not be monotone): every turn held its whole KV, and the last turn's
    # context (~4x the first's) took slots' bytes.
    assert all(p >= n for p, n in zip(pages, needed, strict=True)), (pages, needed)
    assert max(slots[-2:]) < slots[0] and min(pages[-2:]) > pages[0]
    # The session ends: its cached pages go stale; a short request lets slots come back.
    engine.radix.reset()
    for _ in range(3):
        short = [rng.randrange(3, 320) for _ in range(20)]
        assert _run(engine, short) == resident.generate(short, SP).token_ids
    assert engine.memory.stats()["slots"] > slots[-1]
    reasons = [r.reason for r in engine.memory.trace.records]
    assert any("kv" in r for r in reasons)
    engine.check_integrity()


@pytest.mark.parametrize("policy", ["transfer", "direct"])
def test_budget_cut_mid_generation_keeps_outputs(model, policy):
    path, resident, rng = model
    spec = resident.spec
    # direct with every expert fitting loads resident: 28 slots of budget, 16 of them the
    # streamer's own staging (too few to lend), leave 12 of the 16 rows
    slots, cut_slots = (40, 12) if policy == "transfer" else (28, 6)
    engine = _elastic(path, resident, slots=slots, policy=policy, lend=False)
    prompt = [rng.randrange(3, 320) for _ in range(120)]
    want = resident.generate(prompt, SP).token_ids
    cut = engine.memory.budget - cut_slots * spec.expert_bytes

    def on_step(n: int) -> None:
        if n == 3:
            engine.set_gpu_budget(cut)
        if n == 5 and policy == "direct":  # emptied after the cut: the next steps must miss
            engine.loaded.bank.cache.reset()  # (a peaked router kept all decode on residents)

    assert _run(engine, prompt, on_step) == want
    if policy == "direct":  # decode read misses from the pool, on the arena's slots
        assert engine.stats()["experts"]["direct"] > 0
    st = engine.memory.stats()
    assert st["budget"] == cut
    used = st["fixed_bytes"] + engine.kv.allocator.n_pages * engine.memory.arena.kv_unit.nbytes
    used += st["slots"] * resident.spec.expert_bytes
    assert used <= cut  # the split fits the new budget
    assert engine.memory.trace.records[-1].budget == cut
    with pytest.raises(InvalidRequestError, match="does not cover"):
        engine.set_gpu_budget(st["fixed_bytes"] // 2)


@pytest.mark.parametrize("policy", ["gpu-fill", "adaptive"])
def test_budget_cut_under_the_device_path_with_popularity_pins(model, policy):
    """The device path's cache (its tables owned by the device between hand-backs) with
    popularity pins chosen every other step (EngineConfig.popular_pins, on by default): a
    budget cut mid-generation evicts and moves slots under the pins, and the outputs stay the
    resident engine's, with the cache consistent after every step."""
    path, resident, rng = model
    spec = resident.spec
    # 3 layers of 8 experts: a budget of 20-22 slots keeps 16 as prefill staging of its own
    engine = _elastic(path, resident, slots=rng.randint(20, 22), policy=policy, lend=False)
    pins = engine.loaded.bank.popular
    assert pins is not None and engine.config.pins_fraction > 0
    pins.every = 2
    fills = engine.loaded.bank.cache.on_device
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompt = [rng.randrange(3, 320) for _ in range(rng.randint(20, 60))]
    want = resident.generate(prompt, sp).token_ids
    cut_at = rng.randint(4, 10)
    cut_slots = rng.randint(1, 2)
    pinned = []
    rid = engine.submit(prompt, sp)
    n = 0
    cache = engine.loaded.bank.cache
    while engine.has_unfinished():
        engine.step()
        if fills.owned:  # no plan may take a slot out of service: they stay PINNED
            assert bool((fills.stamp[: cache.first_slot] == PINNED).all()), n
        pinned.append(int(fills.popular.sum()))
        engine.check_integrity()
        n += 1
        if n == cut_at:
            # every free page and some slots: the slots must shrink under the pins
            slots_before = engine.memory.stats()["slots"]
            free = engine.kv.allocator.n_free * engine.memory.arena.kv_unit.nbytes
            cut = engine.memory.budget - free - cut_slots * spec.expert_bytes
            engine.set_gpu_budget(cut)
    assert engine._collect(rid).token_ids == want
    assert max(pinned[:cut_at]) > 0 and max(pinned[cut_at:]) > 0, pinned  # pins before, after
    st = engine.memory.stats()
    assert st["slots"] < slots_before  # the cut took slots, not only free pages
    assert st["budget"] == cut
    used = st["fixed_bytes"] + engine.kv.allocator.n_pages * engine.memory.arena.kv_unit.nbytes
    assert used + st["slots"] * spec.expert_bytes <= cut  # the split fits the new budget


@pytest.mark.parametrize("policy", ["transfer", "gpu-fill", "adaptive"])
def test_pressure_preempts_the_newest_never_fails(model, policy):
    """Three requests decoding, then a budget that holds about one of them beside the fewest
    slots: the newest are preempted (re-prefilled later from the prefix cache), nothing fails,
    every output is the resident engine's. The device path's policies too, with fewer slots so
    that not every expert fits (the pressure leaves them one slot: too few for any pin)."""
    path, resident, rng = model
    slots = 24 if policy == "transfer" else 21
    engine = _elastic(path, resident, slots=slots, kv_tokens=1024, policy=policy, lend=False)
    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    prompts = [[rng.randrange(3, 320) for _ in range(200)] for _ in range(3)]
    want = [resident.generate(p, sp).token_ids for p in prompts]
    rids = [engine.submit(p, sp) for p in prompts]
    while len(engine.scheduler.running) < 3 or engine.scheduler.running[-1].prefilling:
        engine.step()
    m = engine.memory
    floor = m.fixed + engine.loaded.bank.min_slots * resident.spec.expert_bytes
    engine.set_gpu_budget(floor + 20 * m.arena.kv_unit.nbytes)  # 13 pages a request now
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
    got = [engine._collect(r) for r in rids]
    assert [g.token_ids for g in got] == want
    assert all(g.finish_reason == "length" for g in got)
    assert m.preempted + engine.scheduler.preemptions > 0
    assert engine.kv.allocator.n_pages <= 20
    if policy != "transfer":  # decode ran on the device path (adaptive: its first steps)
        assert engine.loaded.bank.cache.on_device.releases > 0
        assert engine.loaded.bank.popular is not None


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["transfer", "direct"])
def test_elastic_on_cuda_matches_resident_through_a_budget_cut(tmp_path, rng_seed, policy):
    """The arena on CUDA: strided KV pages and slots under decode graphs (segmented; direct:
    one a step, misses read from the pinned pool), a budget cut mid-generation, the resident
    engine's tokens."""
    make_tiny("qwen3_moe", tmp_path, rng_seed, max_position_embeddings=2048)
    rng = random.Random(rng_seed)
    opts = dict(device="cuda", progress=False, max_model_len=1024, max_num_seqs=4)
    resident = Engine.load(tmp_path, policy="resident", **opts)
    prompts = [[rng.randrange(3, 320) for _ in range(n)] for n in (7, 150, 300)]
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in resident.generate(prompts, sp)]
    spec = resident.spec
    # The offloaded engine keeps an untied embedding table on the host (auto, on CUDA): its
    # dense bytes leave the table out, or the slots below would hold every expert.
    table = 0 if spec.tie_word_embeddings else resident.loaded.model.embed_tokens.weight.nbytes
    dense = dense_nbytes(resident.loaded.model) - table
    kv_unit = 2 * spec.n_layers * 16 * spec.n_kv_heads * spec.head_dim * 4
    # direct with every expert fitting loads resident: 26 slots of budget (and 7 spare KV
    # pages), 16 of them the streamer's own staging, leave about 13 of the 16 rows
    slots, cut_slots = (41, 12) if policy == "transfer" else (26, 6)
    budget = dense + workspace_bytes(spec, resident.config, offloaded=True) + 40 * kv_unit
    budget += slots * spec.expert_bytes
    engine = Engine.load(
        tmp_path, policy=policy, gpu_budget=budget, kv_tokens=512,
        elastic_group_bytes=4 * spec.expert_bytes, stream_min_tokens=128, **opts,
    )  # fmt: skip
    assert engine.memory is not None and engine.runner.graphs is not None
    assert engine.loaded.model.embed_tokens.on_host == (table > 0)
    rids = [engine.submit(p, sp) for p in prompts]
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        if steps == 5:
            engine.set_gpu_budget(budget - cut_slots * spec.expert_bytes)
        engine.check_integrity()
    assert [engine._collect(r).token_ids for r in rids] == want
    assert len(engine.memory.trace) > 1


def test_request_that_cannot_fit_the_cut_budget_fails_clearly(model):
    """A budget cut below what a waiting request needs: it fails with a message naming the
    shortfall after a safe point had its chance, instead of waiting forever; others go on."""
    path, resident, rng = model
    engine = _elastic(path, resident, slots=40, lend=False)
    m = engine.memory
    floor = m.fixed + engine.loaded.bank.min_slots * resident.spec.expert_bytes
    engine.set_gpu_budget(floor + 8 * m.arena.kv_unit.nbytes)  # 8 pages: 128 tokens of KV
    big = [rng.randrange(3, 320) for _ in range(300)]
    small = [rng.randrange(3, 320) for _ in range(20)]
    out = engine.generate(big, SP)
    assert out.finish_reason == "error" and "needs KV for 300 tokens" in out.error
    assert engine.generate(small, SP).token_ids == resident.generate(small, SP).token_ids
    engine.check_integrity()


def test_a_budget_below_the_floor_is_refused_and_names_the_floor(model):
    """Between the fixed bytes and the floor a budget used to be raised to the floor in
    silence: the engine then held more than it was allowed."""
    path, resident, rng = model
    engine = _elastic(path, resident, slots=40)
    m = engine.memory
    before, ask = m.budget, rng.randrange(m.fixed + 1, m.floor)
    slots = engine.loaded.bank.min_slots
    with pytest.raises(InvalidRequestError, match=(
        rf"budget of {ask} bytes does not cover this engine's floor of {m.floor}: {m.fixed} "
        rf"bytes of dense weights, workspace and recurrent memory, 2 KV pages "
        rf"\({2 * m.arena.kv_unit.nbytes}\) and the {slots} expert slots offloading runs with "
        rf"\({slots * m.arena.slot_unit.nbytes}\)"
    )):  # fmt: skip
        engine.set_gpu_budget(ask)
    assert (m.budget, m.user_budget) == (before, before)
    engine.set_gpu_budget(m.floor)  # the floor itself: taken, and held to
    assert m.budget == m.floor and m.held_bytes() <= m.floor
    engine.check_integrity()


def test_budget_follows_free_memory_as_another_program_takes_and_releases(model):
    """Another program takes more than the free headroom: at the next safe point the engine
    drops its budget by the shortfall and unmaps arena chunks until the reserve is free again,
    mid-generation and with exact outputs; when the program exits the budget comes back."""
    path, resident, rng = model
    engine = _elastic(path, resident, slots=40, lend=False)
    m = engine.memory
    chunk, sb = m.arena.slot_memory.chunk, resident.spec.expert_bytes
    reserve, headroom = rng.randint(2, 4) * chunk, rng.randint(0, 2) * sb
    # A device that holds the engine at its budget (and the backing's slack), the reserve and
    # a headroom of 0-2 slots.
    total = m.used_bytes() + m.budget - m.held_bytes() + reserve + headroom
    dev = SimulatedDevice(total, m.used_bytes)  # the other program holds `taken`
    m.watch(dev.free_memory, reserve=reserve, poll_s=0)
    budget0, mapped0 = m.budget, m.mapped_bytes
    slack0 = m.used_bytes() - m.held_bytes()
    assert budget0 == m.user_budget  # the headroom covers the load-time budget
    taken = rng.randint(12, 16) * sb  # about a third of the slots

    def on_step(n: int) -> None:
        if n == 2:
            dev.taken = taken

    prompt = [rng.randrange(3, 320) for _ in range(rng.randint(60, 120))]
    assert _run(engine, prompt, on_step) == resident.generate(prompt, SP).token_ids
    assert m.budget <= budget0 - (taken - headroom) + chunk
    assert m.mapped_bytes < mapped0 and m.released_bytes > 0
    free, _ = dev.free_memory()
    assert free >= reserve - 2 * chunk, (free, reserve)  # the other program has its bytes
    squeezed = m.stats()["slots"]

    dev.taken = 0  # it exits
    prompt = [rng.randrange(3, 320) for _ in range(rng.randint(20, 60))]
    assert _run(engine, prompt) == resident.generate(prompt, SP).token_ids
    for _ in range(10):  # idle safe points (an EngineService polls like this)
        engine.poll_memory()
    # Back to the start, less what the backing's slack grew beyond the headroom (partial
    # chunks mapped at a lane's top or the first slot: memory the engine really holds; one
    # seed grew it by 24 KiB), give or take a chunk of it moving between polls.
    grew = max(0, m.used_bytes() - m.held_bytes() - slack0 - headroom)
    assert 0 <= budget0 - m.budget <= grew + chunk, (budget0, m.budget, grew)
    assert m.stats()["slots"] > squeezed
    reasons = [r.reason for r in m.trace.records]
    assert len({r.budget for r in m.trace.records}) >= 2, reasons
    engine.check_integrity()


@pytest.mark.gpu
def test_cuda_engine_gives_vram_back_to_another_allocation(tmp_path, rng_seed):
    """On CUDA: the arena on virtual memory, the budget following mem_get_info. An allocation
    beyond the free headroom makes the engine unmap arena chunks (the driver's free memory
    comes back to the reserve) while its outputs stay the resident engine's; freeing it lets
    the engine map them again."""
    over = dict(hidden_size=256, moe_intermediate_size=1024, num_experts=32)
    make_tiny("qwen3_moe", tmp_path, rng_seed, max_position_embeddings=2048, **over)
    rng = random.Random(rng_seed)
    opts = dict(device="cuda", progress=False, max_model_len=1024, max_num_seqs=4)
    resident = Engine.load(tmp_path, policy="resident", **opts)
    prompts = [[rng.randrange(3, 320) for _ in range(n)] for n in (40, 200)]
    sp = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in resident.generate(prompts, sp)]
    budget = _staged_budget(resident, slots=48, kv_tokens=600)
    group = 2 << 20
    # The workspace kept whole: lent, its slots would be mapped where torch never allocated
    # the workspace (an estimate of a full step's), and the budget that follows free memory
    # would settle that much below the one at load (memory_workspace.py).
    engine = Engine.load(
        tmp_path, policy="transfer", gpu_budget=budget, kv_tokens=600,
        elastic_group_bytes=group, stream_min_tokens=128, lend_workspace=False, **opts,
    )  # fmt: skip
    m = engine.memory
    assert m is not None and m.arena.slot_memory.releases  # CUDA virtual memory
    # The kernels loaded first: a module's code takes device memory outside torch's cache,
    # which free memory at the end would miss (86 KB short, run after another test).
    assert engine.generate(prompts[0], sp).token_ids == want[0]
    torch.cuda.synchronize()
    free0, _ = torch.cuda.mem_get_info()
    headroom = 8 << 20
    m.watch(lambda: torch.cuda.mem_get_info(), reserve=free0 - headroom, poll_s=0)
    budget0, mapped0 = m.budget, m.mapped_bytes
    taken_bytes = min(mapped0 // 2, 64 << 20)
    rids = [engine.submit(p, sp) for p in prompts]
    other, steps = None, 0
    # Another program's allocation, made here from a private pool: torch's shared cache could
    # serve it from a segment an earlier test left partly in use (seen on the device after a
    # real-shaped prefill), and the driver's free memory would not move.
    other_pool = torch.cuda.MemPool()
    while engine.has_unfinished():
        engine.step()
        steps += 1
        if steps == 3:
            with torch.cuda.use_mem_pool(other_pool):
                other = torch.empty(taken_bytes, dtype=torch.uint8, device="cuda")
        engine.check_integrity()
    assert [engine._collect(r).token_ids for r in rids] == want
    torch.cuda.synchronize()
    free, _ = torch.cuda.mem_get_info()
    # The backing's slack (a partial chunk at the top of every KV lane and at the first slot)
    # may shift by a chunk each.
    slack = (2 * len(resident.spec.attention_layers) + 2) * m.arena.kv_memory.chunk + group
    assert m.budget < budget0 and m.released_bytes >= taken_bytes - headroom - slack
    assert free >= free0 - headroom - slack, (free0, free)  # the reserve is free again
    del other, other_pool
    torch.cuda.empty_cache()
    for _ in range(10):
        engine.poll_memory()
    assert m.budget == budget0
    out = engine.generate(prompts[0], sp)
    assert out.token_ids == want[0]
    engine.check_integrity()


def test_budget_grows_past_the_load_time_one_up_to_the_ceiling(model):
    """The arena reserves addresses up to `gpu_ceiling` and backs only what the split uses:
    raising the budget past the one at load grows the split (and maps its memory) without a
    restart, outputs unchanged; the ceiling caps it."""
    path, resident, rng = model
    spec = resident.spec
    base = _elastic(path, resident, slots=40)
    budget = base.memory.budget
    ceiling = budget + rng.randint(16, 24) * spec.expert_bytes
    engine = Engine.load(
        path, device="cpu", progress=False, policy="transfer", gpu_budget=budget,
        gpu_ceiling=ceiling, kv_tokens=256, elastic_group_bytes=4 * spec.expert_bytes,
        max_model_len=2048, lend_workspace=False,
    )  # fmt: skip
    m = engine.memory
    assert m.budget == m.user_budget == budget and m.max_budget >= ceiling - spec.expert_bytes
    held0, mapped0 = m.held_bytes(), m.mapped_bytes
    assert m.mapped_bytes < ceiling - m.fixed  # the room is addresses, not memory
    engine.set_gpu_budget(ceiling)
    prompt = [rng.randrange(3, 320) for _ in range(rng.randint(30, 80))]
    assert _run(engine, prompt) == resident.generate(prompt, SP).token_ids
    assert m.budget == ceiling or m.budget == m.max_budget
    # The split took the new bytes (pages here: this model's slots already hold every expert)
    # and the arena backed them.
    assert m.held_bytes() > held0 + (ceiling - budget) // 2 and m.mapped_bytes > mapped0
    assert m.held_bytes() <= m.budget
    engine.set_gpu_budget(ceiling * 4)
    assert m.user_budget == m.max_budget  # capped at the ceiling
    engine.check_integrity()


def _same_budget_elastic_and_fixed(path, device: str, rng: random.Random):
    """A hybrid model (state slots, a checkpoint device tier) loaded twice under one budget
    with one KV size: elastic and a fixed split."""
    opts = dict(device=device, progress=False, policy="transfer", max_model_len=1024,
                kv_tokens=rng.choice([256, 512]))  # fmt: skip
    resident = Engine.load(path, policy="resident", device=device, progress=False)
    spec, config = resident.spec, resident.config
    kv = KVPool.page_bytes(
        len(spec.attention_layers), config.page_size, spec.n_kv_heads, spec.head_dim, spec.dtype
    ) * (opts["kv_tokens"] // config.page_size + 1)
    base = (
        dense_nbytes(resident.loaded.model)
        + workspace_bytes(spec, config, offloaded=True)
        + kv
        + (3 * spec.n_experts + rng.randint(4, 12)) * spec.expert_bytes  # lent staging + slots
    )
    # On CUDA the checkpoint tier is a 16th of the budget: sized from twice the base, it fits.
    dev = torch.device(device)
    budget = base + recurrent_device_bytes(spec, config, dev, spec.dtype, 2 * base)
    fixed = Engine.load(path, gpu_budget=budget, elastic=False, **opts)
    elastic = Engine.load(path, gpu_budget=budget, **opts)
    return elastic, fixed


def _check_counts_what_the_recurrence_holds(elastic: Engine, fixed: Engine) -> None:
    loaded, mem = elastic.loaded, elastic.memory
    assert mem is not None and loaded.recurrence is not None
    bank = loaded.bank
    outside = (
        dense_nbytes(loaded.model)
        + workspace_bytes(elastic.spec, elastic.config, offloaded=True)
        + bank.nbytes
        - bank.cache.nbytes
    )
    # What the budget counts of the recurrence is what it holds: the state slots in the fixed
    # bytes, the checkpoints' device tier too or (resizable) in the split.
    assert mem.fixed + mem.tier.nbytes() == outside + loaded.recurrence.device_bytes
    assert mem.fixed == outside + loaded.recurrence.fixed_device_bytes
    # The split fills what the fixed bytes leave: never fewer slots than the fixed split that
    # holds the same KV (the policy may only trade slots for pages beyond it).
    assert loaded.recurrence.device_bytes == fixed.loaded.recurrence.device_bytes
    assert elastic.loaded.bank.cache.n_slots >= fixed.loaded.bank.cache.n_slots


def test_fixed_bytes_are_what_the_recurrence_holds(tmp_path, rng_seed):
    """The manager's fixed bytes count the recurrent state and the checkpoint device tier as
    allocated, not sized again from the arena (whose addresses reach the ceiling)."""
    make_tiny("qwen3_5_moe", tmp_path, rng_seed, max_position_embeddings=2048)
    elastic, fixed = _same_budget_elastic_and_fixed(tmp_path, "cpu", random.Random(rng_seed))
    _check_counts_what_the_recurrence_holds(elastic, fixed)


@pytest.mark.gpu
def test_cuda_fixed_bytes_are_what_the_recurrence_holds(tmp_path, rng_seed):
    """On CUDA the checkpoint tier is sized from the budget: the device run's elastic engine
    counted it from the ceiling's addresses (8.6 GB for 2 GB held) and ran with fewer slots
    than a fixed split at the same budget."""
    make_tiny("qwen3_5_moe", tmp_path, rng_seed, max_position_embeddings=2048)
    elastic, fixed = _same_budget_elastic_and_fixed(tmp_path, "cuda", random.Random(rng_seed))
    _check_counts_what_the_recurrence_holds(elastic, fixed)


@pytest.mark.gpu
def test_cuda_split_grows_into_memory_torch_only_caches(tmp_path, rng_seed):
    """The device's free memory sits in torch's allocator cache (blocks freed but kept, as a
    prefill chunk's activations are): a budget raise still maps the arena's new slots, because
    a refused map empties that cache and tries again; outputs stay the resident engine's."""
    over = dict(hidden_size=256, moe_intermediate_size=1024, num_experts=32)  # 3 MiB slots
    make_tiny("qwen3_moe", tmp_path, rng_seed, max_position_embeddings=2048, **over)
    rng = random.Random(rng_seed)
    opts = dict(device="cuda", progress=False, max_model_len=1024, max_num_seqs=2)
    resident = Engine.load(tmp_path, policy="resident", **opts)
    prompt = [rng.randrange(3, 320) for _ in range(100)]
    want = resident.generate(prompt, SP).token_ids
    spec = resident.spec
    budget = _staged_budget(resident, slots=8, kv_tokens=512)
    engine = Engine.load(tmp_path, policy="transfer", gpu_budget=budget, kv_tokens=512,
                         follow_free_memory=False, elastic_group_bytes=4 * spec.expert_bytes,
                         **opts)  # fmt: skip
    slots = engine.memory.cache.n_slots
    # Room for every expert: dozens more slots, past the 32 MiB chunks mapped so far.
    grow = 256 << 20
    del resident
    torch.cuda.empty_cache()
    # Take all but 16 MiB of the device through torch, then free it: torch keeps the blocks.
    held, free = [], torch.cuda.mem_get_info()[0]
    while free > (48 << 20):
        try:
            held.append(torch.empty(max(2 << 20, free - (16 << 20)) // 2, dtype=torch.uint8,
                                    device="cuda"))  # fmt: skip
        except torch.cuda.OutOfMemoryError:
            break
        free = torch.cuda.mem_get_info()[0]
    del held
    assert torch.cuda.mem_get_info()[0] < grow, "torch's cache should hold the free memory"
    assert torch.cuda.memory_reserved() > grow
    engine.set_gpu_budget(budget + grow)
    m = engine.memory
    assert m.map_failures == 0 and m.cache.n_slots > slots, (m.map_failures, slots)
    assert engine.generate(prompt, SP).token_ids == want
    engine.check_integrity()


def test_steady_decode_decides_every_few_steps_and_a_cut_at_once(model):
    """A decode step that moves nothing the split rests on (no new page, same requests, same
    budget) skips the decision but every FULL_EVERY steps; a budget cut is decided at the
    very next safe point; the outputs stay the resident engine's."""
    from freetoken_agent.engine.memory_cadence import FULL_EVERY

    path, resident, rng = model
    engine = _elastic(path, resident, slots=40, kv_tokens=512)
    memory, calls = engine.memory, []
    decide = memory.policy.decide

    def counted(d):
        calls.append(memory.steps)
        return decide(d)

    memory.policy.decide = counted
    n_decode = rng.randrange(40, 60)
    sp = SamplingParams(max_tokens=n_decode, temperature=0, ignore_eos=True)
    prompt = [rng.randrange(3, 320) for _ in range(rng.randrange(20, 40))]
    rid = engine.submit(prompt, sp)
    steps, cut_at = 0, rng.randrange(15, 30)
    while engine.has_unfinished():
        if steps == cut_at:  # busy: applied at the next step's safe point
            engine.set_gpu_budget(memory.budget - 8 * resident.spec.expert_bytes)
        engine.step()
        engine.check_integrity()
        steps += 1
        if steps == cut_at + 1:
            assert calls[-1] == memory.steps, "the cut was not decided at once"
    assert engine._collect(rid).token_ids == resident.generate(prompt, sp).token_ids
    # Decisions: the first steps, the cut, the request's end, and one every FULL_EVERY steps
    # in between. Not the pages the answer fills (one every 16 tokens): they were in its
    # lookahead, so the demand did not move.
    assert len(calls) <= steps // FULL_EVERY + 4, (calls, steps)
    gaps = [b - a for a, b in itertools.pairwise(calls)]
    assert max(gaps) <= FULL_EVERY, gaps  # the cold tail is never left unread for longer


def test_a_cut_to_just_above_the_floor_holds_within_the_budget(model):
    """Cut in one step to the floor plus a fraction of a few pages, the idle engine's split
    stays within the budget. The policy gave the bytes of its one hard page (the scratch
    page) and the rest to slots, then the split was raised to the floor's two pages: a slot
    more than the budget held. Requests then run as before."""
    path, resident, rng = model
    engine = _elastic(path, resident, slots=40)
    m = engine.memory
    for whole in range(6):  # a cut within each of the first 6 pages past the floor
        budget = m.floor + int((whole + rng.uniform(0.05, 0.95)) * m.arena.kv_unit.nbytes)
        engine.set_gpu_budget(budget)
        engine.step()
        assert m.held_bytes() <= budget, (m.held_bytes() - budget, m.cache.n_slots)
        engine.check_integrity()
        engine.set_gpu_budget(m.max_budget)
        engine.step()
    prompt = [rng.randrange(3, 320) for _ in range(20)]
    assert _run(engine, prompt) == resident.generate(prompt, SP).token_ids


@pytest.mark.parametrize("policy", ["transfer", "static"])
def test_a_request_that_exactly_fits_the_budget_runs(model, policy):
    """The budget holds the scratch page, the request's pages (its prompt and answer fill them
    exactly) and the fewest slots, not a page more: the idle engine admits it and it decodes
    the resident tokens. The policy counted one page twice there and failed it for want of
    KV it had room for."""
    path, resident, rng = model
    engine = _elastic(path, resident, slots=40, policy=policy)
    m = engine.memory
    need = rng.randint(3, 6)  # pages (16 tokens each)
    n_out = rng.randint(1, 12)
    prompt = [rng.randrange(3, 320) for _ in range(16 * need - n_out)]
    sp = SamplingParams(max_tokens=n_out, temperature=0, ignore_eos=True)
    pages, slots = 1 + need, engine.loaded.bank.min_slots
    engine.set_gpu_budget(
        m.fixed + pages * m.arena.kv_unit.nbytes + slots * m.arena.slot_unit.nbytes
    )
    out = engine.generate(prompt, sp)
    assert (out.finish_reason, out.error) == ("length", None)
    assert out.token_ids == resident.generate(prompt, sp).token_ids
    engine.check_integrity()


def test_a_request_whose_lookahead_does_not_fit_runs_on_its_prompts_pages(model):
    """Room for the request's prompt and a few tokens, not for its lookahead (up to 256 answer
    tokens): it is admitted and ends at its stop token as the resident engine does (it was
    left with no page at all, and failed)."""
    path, resident, rng = model
    engine = _elastic(path, resident, slots=40)
    m = engine.memory
    prompt = [rng.randrange(3, 320) for _ in range(rng.randint(30, 60))]
    free = resident.generate(prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    stop = free.token_ids[rng.randint(0, 3)]  # the model writes it within 4 tokens
    sp = SamplingParams(max_tokens=300, temperature=0, stop_token_ids=[stop])
    want = resident.generate(prompt, sp)
    pages = 1 + -(-(len(prompt) + 8) // 16)  # the scratch page, the prompt and 8 more tokens
    slots = engine.loaded.bank.min_slots
    engine.set_gpu_budget(
        m.fixed + pages * m.arena.kv_unit.nbytes + slots * m.arena.slot_unit.nbytes
    )
    out = engine.generate(prompt, sp)
    assert (out.finish_reason, out.error) == (want.finish_reason, None) == ("stop", None)
    assert out.token_ids == want.token_ids
    engine.check_integrity()


def test_a_failed_admissions_page_copy_never_lands_on_a_cached_prefix(model):
    """A waiting request that shares a cached prefix into the middle of a page queues a copy
    of that page at admission, then cannot get the rest of its pages under a cut budget: it
    goes back to waiting, and its copy must go with it. Left queued across the step that ran
    nothing, a second cut moved a cached page into the copy's destination and the next step
    overwrote it: a later request reusing that prefix read the wrong KV (NaN logits)."""
    path, resident, rng = model
    engine = _elastic(path, resident, slots=40, kv_tokens=1024, lend=False)
    m, sp = engine.memory, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=2)
    unit = m.arena.kv_unit.nbytes
    a, b = ([rng.randrange(3, 320) for _ in range(200)] for _ in range(2))
    ids = [engine.submit(a, sp, use_prefix_cache=False), engine.submit(b, sp)]
    while engine.has_unfinished():
        engine.step()
    for rid in ids:
        engine.release(rid)
    engine.set_gpu_budget(m.floor + 36 * unit)  # idle: applied now
    cut = 16 * rng.randrange(8, 12) + rng.randrange(1, 16)  # b's prefix into a page's middle
    rid = engine.submit(b[:cut] + [rng.randrange(3, 320) for _ in range(470)], sp)  # > 36 pages
    engine.step()  # admitted, the partial page copied, then short of pages: back to waiting
    engine.check_integrity()  # (every queued copy writes a live request's page)
    engine.set_gpu_budget(m.floor + 26 * unit)  # too small for it now: it fails
    engine.step()
    assert engine._collect(rid).finish_reason == "error"
    engine.release(rid)
    engine.generate([rng.randrange(3, 320) for _ in range(5)], sp)  # a step that runs
    reuse = b[: 16 * rng.randrange(6, 12)] + [rng.randrange(3, 320) for _ in range(3)]
    got, want = engine.generate(reuse, sp), resident.generate(reuse, sp)
    # (whatever of b the cuts left cached is reused: none, some seeds)
    assert got.token_ids == want.token_ids, got.error
    assert max(abs(x.logprob - y.logprob) for x, y in zip(got.logprobs, want.logprobs,
                                                          strict=True)) < 1e-4  # fmt: skip
    engine.check_integrity()
