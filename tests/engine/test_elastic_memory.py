"""Elastic memory on the CPU with a simulated GPU budget: KV pages and expert slots share one
arena whose split moves at safe points, with outputs unchanged and every pool intact."""

from __future__ import annotations

import random

import pytest
from tiny_models import make_tiny

from freetoken_agent import Engine, SamplingParams
from freetoken_agent.engine.experts.placement import workspace_bytes
from freetoken_agent.engine.loading import dense_nbytes
from freetoken_agent.engine.outputs import InvalidRequestError

SP = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture
def model(tmp_path, rng_seed):
    make_tiny("qwen3_moe", tmp_path, rng_seed, max_position_embeddings=2048)
    resident = Engine.load(tmp_path, device="cpu", progress=False, policy="resident")
    return tmp_path, resident, random.Random(rng_seed)


def _elastic(path, resident: Engine, slots: int, kv_tokens: int = 256) -> Engine:
    """An engine whose budget holds the dense weights, the workspace, `kv_tokens` of KV and
    `slots` expert slots; the split moves in groups of 4 slots."""
    spec, config = resident.spec, resident.config
    dense = dense_nbytes(resident.loaded.model)
    kv_unit = 2 * len(spec.attention_layers) * 16 * spec.n_kv_heads * spec.head_dim * 4
    budget = (
        dense
        + workspace_bytes(spec, config)
        + (kv_tokens // 16 + 1) * kv_unit
        + (slots + 1) * spec.expert_bytes
    )
    engine = Engine.load(
        path, device="cpu", progress=False, policy="transfer", gpu_budget=budget,
        kv_tokens=kv_tokens, elastic_group_bytes=4 * spec.expert_bytes, max_model_len=2048,
    )  # fmt: skip
    assert engine.memory is not None
    return engine


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
    pages, slots = [], []
    for _ in range(5):  # an agent session: each turn adds to the context (to ~510 tokens)
        history += [rng.randrange(3, 320) for _ in range(rng.randrange(80, 90))]
        assert _run(engine, history) == resident.generate(history, SP).token_ids
        st = engine.memory.stats()
        pages.append(st["kv_pages"])
        slots.append(st["slots"])
    assert pages[-1] > first["kv_pages"] and slots[-1] < first["slots"]
    assert pages == sorted(pages) and slots == sorted(slots, reverse=True)
    # The session ends: its cached pages go stale; a short request lets slots come back.
    engine.radix.reset()
    for _ in range(3):
        short = [rng.randrange(3, 320) for _ in range(20)]
        assert _run(engine, short) == resident.generate(short, SP).token_ids
    assert engine.memory.stats()["slots"] > slots[-1]
    reasons = [r.reason for r in engine.memory.trace.records]
    assert any("kv" in r for r in reasons)
    engine.check_integrity()


def test_budget_cut_mid_generation_keeps_outputs(model):
    path, resident, rng = model
    engine = _elastic(path, resident, slots=40)
    prompt = [rng.randrange(3, 320) for _ in range(120)]
    want = resident.generate(prompt, SP).token_ids
    cut = engine.memory.budget - 12 * resident.spec.expert_bytes

    def on_step(n: int) -> None:
        if n == 3:
            engine.set_gpu_budget(cut)

    assert _run(engine, prompt, on_step) == want
    st = engine.memory.stats()
    assert st["budget"] == cut
    used = st["fixed_bytes"] + engine.kv.allocator.n_pages * engine.memory.arena.kv_unit.nbytes
    used += st["slots"] * resident.spec.expert_bytes
    assert used <= cut  # the split fits the new budget
    assert engine.memory.trace.records[-1].budget == cut
    with pytest.raises(InvalidRequestError, match="does not cover"):
        engine.set_gpu_budget(st["fixed_bytes"] // 2)


def test_pressure_preempts_the_newest_never_fails(model):
    """Three requests decoding, then a budget that holds about one of them beside the fewest
    slots: the newest are preempted (re-prefilled later from the prefix cache), nothing fails,
    every output is the resident engine's."""
    path, resident, rng = model
    engine = _elastic(path, resident, slots=24, kv_tokens=1024)
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


@pytest.mark.gpu
def test_elastic_on_cuda_matches_resident_through_a_budget_cut(tmp_path, rng_seed):
    """The arena on CUDA: strided KV pages and slots under segmented decode graphs, a budget
    cut mid-generation, the resident engine's tokens."""
    make_tiny("qwen3_moe", tmp_path, rng_seed, max_position_embeddings=2048)
    rng = random.Random(rng_seed)
    opts = dict(device="cuda", progress=False, max_model_len=1024, max_num_seqs=4)
    resident = Engine.load(tmp_path, policy="resident", **opts)
    prompts = [[rng.randrange(3, 320) for _ in range(n)] for n in (7, 150, 300)]
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in resident.generate(prompts, sp)]
    spec = resident.spec
    dense = dense_nbytes(resident.loaded.model)
    kv_unit = 2 * spec.n_layers * 16 * spec.n_kv_heads * spec.head_dim * 4
    budget = dense + workspace_bytes(spec, resident.config) + 40 * kv_unit + 41 * spec.expert_bytes
    engine = Engine.load(
        tmp_path, policy="transfer", gpu_budget=budget, kv_tokens=512,
        elastic_group_bytes=4 * spec.expert_bytes, stream_min_tokens=128, **opts,
    )  # fmt: skip
    assert engine.memory is not None and engine.runner.graphs is not None
    rids = [engine.submit(p, sp) for p in prompts]
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        if steps == 5:
            engine.set_gpu_budget(budget - 12 * spec.expert_bytes)
        engine.check_integrity()
    assert [engine._collect(r).token_ids for r in rids] == want
    assert len(engine.memory.trace) > 1


def test_request_that_cannot_fit_the_cut_budget_fails_clearly(model):
    """A budget cut below what a waiting request needs: it fails with a message naming the
    shortfall after a safe point had its chance, instead of waiting forever; others go on."""
    path, resident, rng = model
    engine = _elastic(path, resident, slots=40)
    m = engine.memory
    floor = m.fixed + engine.loaded.bank.min_slots * resident.spec.expert_bytes
    engine.set_gpu_budget(floor + 8 * m.arena.kv_unit.nbytes)  # 8 pages: 128 tokens of KV
    big = [rng.randrange(3, 320) for _ in range(300)]
    small = [rng.randrange(3, 320) for _ in range(20)]
    out = engine.generate(big, SP)
    assert out.finish_reason == "error" and "needs KV for 300 tokens" in out.error
    assert engine.generate(small, SP).token_ids == resident.generate(small, SP).token_ids
    engine.check_integrity()
