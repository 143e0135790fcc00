"""The step workspace lent to expert slots (engine/memory_workspace.py): while only decodes run,
the part of a full step's workspace they cannot need holds slots; a prompt takes it back before
its first chunk, and no step's workspace ever overruns the budget. On the CPU with a simulated
GPU budget; the tokens are the resident engine's throughout."""

from __future__ import annotations

import functools
import random

import pytest
import torch
from tiny_models import make_tiny

from freetoken_agent import Engine, SamplingParams
from freetoken_agent.engine.experts.placement import workspace_bytes
from freetoken_agent.engine.experts.streaming import ring_slots
from freetoken_agent.engine.loading import dense_nbytes
from freetoken_agent.engine.memory import GIB, MemoryDemand, MemoryPolicy
from freetoken_agent.engine.memory_workspace import StepWorkspace

MIB = 1 << 20
# 256 experts of ~25 KB: more than the KV pages an idle engine gives back hold, and ~5x the
# workspace lent (a 512-token step's is ~55 experts)
SHAPE = dict(max_position_embeddings=4096, num_experts=64, num_hidden_layers=4, mlp_only_layers=[])


@pytest.fixture
def model(tmp_path, rng_seed):
    make_tiny("qwen3_moe", tmp_path, rng_seed, **SHAPE)
    resident = Engine.load(tmp_path, device="cpu", progress=False, policy="resident")
    return tmp_path, resident, random.Random(rng_seed)


def _engine(path, resident: Engine, rng: random.Random, lend: bool = True) -> Engine:
    """An engine whose budget holds the dense weights, a full step's workspace (512 tokens: an
    expert is ~10 tokens of it), 1280 tokens of KV and ~60 of the 256 experts; addresses for
    every expert (gpu_ceiling)."""
    spec = resident.spec
    config = resident.config.__class__(max_batched_tokens=512)
    n_rows = spec.n_moe_layers * spec.n_experts
    kv_unit = 2 * len(spec.attention_layers) * 16 * spec.n_kv_heads * spec.head_dim * 4
    fixed = dense_nbytes(resident.loaded.model) + workspace_bytes(spec, config, offloaded=True)
    staging = ring_slots(spec.n_experts, 2)  # of its own: too few slots to lend it
    budget = fixed + 81 * kv_unit + (staging + rng.randint(56, 64)) * spec.expert_bytes
    return Engine.load(
        path, device="cpu", progress=False, policy="transfer", gpu_budget=budget,
        gpu_ceiling=budget + (n_rows + 2) * spec.expert_bytes, kv_tokens=1280,
        elastic_group_bytes=spec.expert_bytes, max_model_len=4096, lend_workspace=lend,
        stream_min_tokens=64, max_batched_tokens=512,
    )  # fmt: skip


class StepWatch:
    """Wraps the scheduler: every scheduled step's tokens beside the bytes the split holds,
    the slots, the workspace lent and the step's cap, taken when the step is decided."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.steps = engine, []
        sched = engine.scheduler
        real = sched.schedule

        def schedule():
            batch = real()
            m = engine.memory
            a = m.arena
            split = engine.kv.allocator.n_pages * a.kv_unit.nbytes
            split += m.cache.n_slots * a.slot_unit.nbytes
            tokens = sum(len(c.token_ids) for c in batch.chunks)
            self.steps.append((tokens, split, m.cache.n_slots, m.budget, m.lent, sched.step_tokens))
            return batch

        sched.schedule = schedule

    def check_budget(self) -> None:
        """Every step: the bytes outside the split (a full step's workspace out) plus the
        workspace of the step's own tokens plus the split fit the budget."""
        m = self.engine.memory
        ws = m.workspace
        base = m.fixed_most - ws.full
        for tokens, split, _, budget, _, _ in self.steps:
            if tokens:
                assert base + ws.bytes_for(tokens) + split <= budget, (tokens, split, budget)


def test_decode_lends_the_workspace_to_slots_and_a_prompt_takes_it_back(model):
    path, resident, rng = model
    engine = _engine(path, resident, rng)
    kept = _engine(path, resident, rng, lend=False)  # the same budget, the workspace whole
    watch, m = StepWatch(engine), engine.memory
    sp = SamplingParams(max_tokens=rng.randint(24, 40), temperature=0, ignore_eos=True)
    short = [rng.randrange(3, 320) for _ in range(rng.randint(8, 30))]
    long = [rng.randrange(3, 320) for _ in range(rng.randint(600, 1100))]
    want_short, want_long = (resident.generate(p, sp).token_ids for p in (short, long))
    assert kept.generate(short, sp).token_ids == want_short
    kept_slots = kept.memory.cache.n_slots

    a = engine.submit(short, sp)
    while not engine.scheduler.running or len(engine.scheduler.running[0].output_ids) < 8:
        engine.step()  # until it decodes: the workspace is lent
        engine.check_integrity()
    decoding_slots = m.cache.n_slots
    assert m.lent > 0 and decoding_slots > kept_slots, (m.lent, decoding_slots, kept_slots)
    n_before = len(watch.steps)
    b = engine.submit(long, sp)  # a long prompt arrives mid-answer
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
    assert engine._collect(a).token_ids == want_short
    assert engine._collect(b).token_ids == want_long
    watch.check_budget()
    # Its first chunk was not cut short by the lending: the slots gave the workspace back
    # before it was scheduled (its step: the other's decode and as much of the prompt as fits).
    tokens, _, slots, _, _, _ = watch.steps[n_before]
    assert tokens == min(1 + len(long), engine.scheduler.max_batched_tokens)
    assert slots < decoding_slots
    # Done: the slots take the workspace again (a short answer decodes on them).
    engine.generate(short, sp)
    assert m.lent > 0 and m.cache.n_slots > slots
    assert engine.stats()["elastic"]["workspace_lent"] == m.lent


def test_a_count_that_falls_behind_shortens_the_chunk_instead(model, monkeypatch):
    """The workspace count stays at a decode's while a long prompt comes (as if the slots
    could not give it back yet): they keep the lent workspace, so the step is capped at the
    tokens the bytes left over cover; the prompt runs in shorter chunks, never over the
    budget, its tokens exact."""
    path, resident, rng = model
    engine = _engine(path, resident, rng)
    watch, m = StepWatch(engine), engine.memory
    sp = SamplingParams(max_tokens=rng.randint(4, 8), temperature=0, ignore_eos=True)
    engine.generate([rng.randrange(3, 320) for _ in range(12)], sp)  # slots took the workspace
    assert m.lent > 0
    monkeypatch.setattr(m, "_count_workspace", lambda: None)
    prompt = [rng.randrange(3, 320) for _ in range(rng.randint(600, 1100))]
    n_before = len(watch.steps)
    out = engine.generate(prompt, sp)
    assert out.error is None and out.token_ids == resident.generate(prompt, sp).token_ids
    watch.check_budget()
    first, cap = watch.steps[n_before][0], watch.steps[n_before][-1]
    assert first == cap < min(len(prompt), engine.scheduler.max_batched_tokens), (first, cap)


def test_lending_off_keeps_the_whole_workspace(model):
    path, resident, rng = model
    engine = _engine(path, resident, rng, lend=False)
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompt = [rng.randrange(3, 320) for _ in range(rng.randint(10, 40))]
    assert engine.generate(prompt, sp).token_ids == resident.generate(prompt, sp).token_ids
    m = engine.memory
    assert m.workspace is None and m.lent == 0 and m.fixed == m.fixed_most
    assert engine.scheduler.step_tokens is None


def test_the_workspace_count_rounds_and_covers(model):
    """`rounded` is a power of two within [least, most] at or above the tokens (or most);
    `covered(room)` is the most tokens whose workspace fits the room, `least` when none does."""
    _, resident, rng = model
    spec = resident.spec
    for _ in range(20):
        config = resident.config.__class__(
            max_num_seqs=rng.randint(1, 64), max_batched_tokens=rng.randint(64, 16384)
        )
        ws = StepWorkspace(spec, config)
        assert ws.full == workspace_bytes(spec, config, offloaded=True)
        t = rng.randint(1, 20000)
        r = ws.rounded(t)
        assert ws.least <= r <= ws.most
        assert r == ws.most or (r >= t and r & (r - 1) == 0)
        room = rng.randint(ws.bytes_for(ws.least) - 1000, ws.full + 1000)
        n = ws.covered(room)
        assert ws.least <= n <= ws.most
        if ws.bytes_for(ws.least) <= room:
            assert ws.bytes_for(n) <= room
            assert n == ws.most or ws.bytes_for(n + 1) > room
        else:
            assert n == ws.least


def test_the_policy_lends_the_workspace_to_slots_only(rng_seed):
    """Random demands with part of `fixed` lent: the split's pages fit the budget without the
    lent bytes (a prompt's workspace takes them back by evicting slots, never a request's
    KV), its slots may use them, and with nothing lent the answer is the same as before."""
    rng = random.Random(rng_seed)
    for _ in range(300):
        pb, sb = rng.choice([1, 2, 3]) * MIB, rng.choice([3, 6, 25]) * MIB
        max_slots = rng.randint(50, 2000)
        d = MemoryDemand(
            budget=rng.randint(4, 40) * GIB, fixed=rng.randint(1, 3) * GIB, page_bytes=pb,
            slot_bytes=sb, pages_now=rng.randint(0, 4000), slots_now=rng.randint(0, max_slots),
            pages_held=rng.randint(0, 1000), pages_growth=rng.randint(0, 100),
            pages_waiting=rng.choice([0, rng.randint(1, 500)]),
            cached_recent=rng.randint(0, 400), cached_stale=rng.randint(0, 400),
            min_slots=rng.randint(1, 20), max_slots=max_slots,
            slot_tail_hits=lambda k: 0.01 * k, lent=rng.randint(0, 2 * GIB),
        )  # fmt: skip
        policy = MemoryPolicy(group_bytes=rng.choice([16, 64]) * MIB)
        s = policy.decide(d)
        if s is None or s.reason == "over budget":
            continue
        avail = d.budget - d.fixed
        free = MemoryPolicy.lent_slots(d)
        assert s.pages * pb + max(0, s.slots - free) * sb <= avail, (d, s)
        assert s.slots <= max(d.max_slots, d.min_slots)
        if free and s.reason.startswith("hard"):
            continue
        plain = MemoryPolicy(group_bytes=policy.group_bytes).decide(
            MemoryDemand(
                **{
                    **{f: getattr(d, f) for f in d.__slots__},
                    "lent": 0,
                    "slots_now": max(0, d.slots_now - free),
                    "min_slots": max(0, d.min_slots - free),
                    "max_slots": max(0, d.max_slots - free),
                }
            )  # fmt: skip
        )
        assert plain is not None and (s.pages, s.slots) == (plain.pages, plain.slots + free)


@pytest.mark.gpu
def test_lending_on_cuda_gives_torchs_cached_blocks_back(tmp_path, rng_seed, monkeypatch):
    """On CUDA: a prompt's chunk takes the workspace, the decode after it lends it to slots,
    and torch's allocator returns its cached blocks to the driver before the slots grow into
    their bytes (else the engine would hold both); tokens are the resident engine's."""
    make_tiny("qwen3_moe", tmp_path, rng_seed, **SHAPE)
    rng = random.Random(rng_seed)
    opts = dict(device="cuda", progress=False, max_model_len=4096, max_num_seqs=4)
    resident = Engine.load(tmp_path, policy="resident", **opts)
    spec = resident.spec
    table = 0 if spec.tie_word_embeddings else resident.loaded.model.embed_tokens.weight.nbytes
    dense = dense_nbytes(resident.loaded.model) - table
    n_rows = spec.n_moe_layers * spec.n_experts
    kv_unit = 2 * len(spec.attention_layers) * 16 * spec.n_kv_heads * spec.head_dim * 4
    budget = dense + workspace_bytes(spec, resident.config, offloaded=True) + 130 * kv_unit
    budget += (ring_slots(spec.n_experts, 2) + n_rows // 4) * spec.expert_bytes
    engine = Engine.load(tmp_path, policy="transfer", gpu_budget=budget, kv_tokens=2048,
                         elastic_group_bytes=spec.expert_bytes, stream_min_tokens=64,
                         **opts)  # fmt: skip
    m = engine.memory
    events = []  # ("empty", slots then) at each empty_cache, ("step", slots) after each step
    real = torch.cuda.empty_cache

    def empty_cache():
        events.append(("empty", m.cache.n_slots))
        real()

    monkeypatch.setattr(torch.cuda, "empty_cache", empty_cache)
    sp = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    prompt = [rng.randrange(3, 320) for _ in range(rng.randint(1500, 2000))]
    rid = engine.submit(prompt, sp)
    while engine.has_unfinished():
        engine.step()
        events.append(("step", m.cache.n_slots))
    assert engine._collect(rid).token_ids == resident.generate(prompt, sp).token_ids
    prefill_slots = events[0][1]  # after the prompt's chunk (the workspace counted whole)
    assert m.lent > 0 and m.cache.n_slots > prefill_slots
    # The first growth past the prompt's slots came after a return of torch's cache.
    grown = next(i for i, (kind, n) in enumerate(events) if kind == "step" and n > prefill_slots)
    assert ("empty", prefill_slots) in events[1:grown], events[: grown + 1]
    print(f"slots {prefill_slots} -> {m.cache.n_slots}, lent {m.lent / MIB:.1f} MiB")


def test_the_bench_warm_rows_start_every_run_from_the_same_slots(model):
    """bench offload's warm prefill rows: each run prepares the cache (`_refill`: the idle
    engine's split settled, emptied, every slot filled), then prefills. With the workspace
    lent the split depends on the prompt before (a short one lends more than a full chunk),
    so without the settling the runs of a row started from different slot counts (a review
    found 96, 113, 113 with lengths below, at and above the chunk)."""
    from freetoken_agent.bench.offload import _refill
    from freetoken_agent.bench.offload_limits import prefill_row

    path, resident, rng = model
    engine = _engine(path, resident, rng)
    engine.generate([rng.randrange(3, 320) for _ in range(20)],
                    SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))  # fmt: skip
    chunk = engine.config.max_batched_tokens
    for n in rng.sample([chunk // 2, chunk, 2 * chunk - rng.randint(1, 64)], 3):
        held: list[int] = []
        prefill_row(engine, n, chunk, 1e9, rng, 3, functools.partial(_refill, engine, rng, held))
        assert len(held) == 3 and len(set(held)) == 1, (n, held)
        engine.loaded.bank.cache.reset()


def test_an_arena_with_no_room_lends_nothing_and_says_so(model):
    """A budget at the ceiling: the arena's addresses end where the split's share of the
    budget does, so the slots cannot hold the workspace lent. The stats and the bytes
    counted outside the split say what the split holds (they claimed the whole count)."""
    path, resident, rng = model
    engine = _engine(path, resident, rng)
    budget = engine.memory.budget
    spec = resident.spec
    engine = Engine.load(
        path, device="cpu", progress=False, policy="transfer", gpu_budget=budget,
        gpu_ceiling=budget, kv_tokens=1280, elastic_group_bytes=spec.expert_bytes,
        max_model_len=4096, stream_min_tokens=64, max_batched_tokens=512,
    )  # fmt: skip
    m = engine.memory
    engine.generate([rng.randrange(3, 320) for _ in range(20)],
                    SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))  # fmt: skip
    assert m.lent > 4 * spec.expert_bytes  # counted: a decode needs little of it
    held = engine.stats()["elastic"]["workspace_lent"]
    assert held == m.lent_held <= m.arena.slot_unit.nbytes + m.arena.kv_unit.nbytes
    assert m.fixed == m.fixed_most - held and m.held_bytes() <= m.budget


@pytest.mark.parametrize("loaded", [True, False])
def test_the_bench_switches_lending_inside_one_engine(model, loaded):
    """bench offload --lend-ab: the lending switched at run time (bench/lend_switch.py) moves
    the split at the next safe points both ways, the tokens stay the resident engine's, and
    the engine is as loaded after; each row is measured lent then whole."""
    from freetoken_agent.bench.lend_switch import lend_rows, workspace_lending

    path, resident, rng = model
    engine = _engine(path, resident, rng, lend=loaded)
    m = engine.memory
    sp = SamplingParams(max_tokens=rng.randint(12, 20), temperature=0, ignore_eos=True)
    slots = {}
    for on in (not loaded, loaded, not loaded):
        prompt = [rng.randrange(3, 320) for _ in range(rng.randint(8, 30))]
        with workspace_lending(engine, on):
            out = engine.generate(prompt, sp)
            slots[on] = m.cache.n_slots
            assert (m.workspace is not None) == on and (m.lent > 0) == on
            assert (engine.scheduler.step_tokens is not None) == on
        assert out.token_ids == resident.generate(prompt, sp).token_ids
        assert (m.workspace is not None) == loaded
    assert slots[True] > slots[False]
    rows = [("a", "adaptive", None, None, None), ("t", "transfer", "on", True, 0.5)]
    assert lend_rows(rows, False) == [(*r, None) for r in rows]
    assert lend_rows(rows, True) == [
        ("a+lent", "adaptive", None, None, None, True),
        ("a+whole", "adaptive", None, None, None, False),
        ("t+lent", "transfer", "on", True, 0.5, True),
        ("t+whole", "transfer", "on", True, 0.5, False),
    ]
