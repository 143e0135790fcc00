"""Preemption keeps what a request computed, and a request that cannot progress ends.

A preempted hybrid request is checkpointed where it stops, so readmission restores that state
and computes only what is left (it used to restart at its last anchor, or cold). A request alone
in the engine that is preempted again and again with nothing computed in between is failed with
a message, never retried forever (on the device such a turn ran for minutes).

Scheduler-level tests drive `schedule` / `advance` by hand (the model's work is simulated: the
state slot is filled with random values where the kernels would write it); the engine-level
test runs a tiny hybrid model.
"""

from __future__ import annotations

import random

import pytest
import torch
from elastic_engines import elastic_engine as _elastic_engine
from tiny_models import make_tiny

from freetoken_agent import Engine, SamplingParams
from freetoken_agent.engine.kv.checkpoint_mode import CheckpointMode
from freetoken_agent.engine.kv.checkpoints import CheckpointPool
from freetoken_agent.engine.kv.pool import PageAllocator
from freetoken_agent.engine.kv.radix import RadixCache
from freetoken_agent.engine.kv.recurrent_state import RecurrentStatePool
from freetoken_agent.engine.request import Recurrence, Request, Status
from freetoken_agent.engine.scheduler import MAX_FRUITLESS_PREEMPTIONS, Scheduler

PAGE = 4
CONV, SSM = (6, 3), (2, 4, 4)  # [C, K - 1], [Hv, Dk, Dv]


def _scheduler(n_pages: int, chunk: int, mode: str = "anchors") -> Scheduler:
    alloc = PageAllocator(n_pages)
    radix = RadixCache(PAGE, alloc)
    states = RecurrentStatePool(2, 4, CONV, SSM, torch.float32, "cpu")
    ckpts = CheckpointPool(2, 4, 0, CONV, SSM, torch.float32, "cpu")
    radix.release_checkpoint = ckpts.release
    ckpts.on_drop = radix.forget_checkpoint
    rec = Recurrence(states, ckpts, CheckpointMode.parse(mode))
    return Scheduler(alloc, radix, PAGE, max_num_seqs=2, max_batched_tokens=chunk, recurrence=rec)


def _compute(sched: Scheduler, batch, rng: torch.Generator) -> None:
    """What a step's kernels would do: write each request's state, then `advance`."""
    states = sched.recurrence.states
    for c in batch.chunks:
        slot = c.request.state_slot
        states.conv[:, slot] = torch.rand((2, *CONV), generator=rng)
        states.ssm[:, slot] = torch.rand((2, *SSM), generator=rng)
        sched.advance(c)


def test_preempted_hybrid_request_resumes_where_it_stopped(rng_seed):
    rng = random.Random(rng_seed)
    gen = torch.Generator().manual_seed(rng_seed)
    chunk = PAGE * rng.randint(2, 4)
    sched = _scheduler(n_pages=64, chunk=chunk)
    n = chunk * rng.randint(3, 5) + rng.randint(1, PAGE - 1)  # several chunks, a partial page
    req = Request("a", [rng.randrange(3, 300) for _ in range(n)], SamplingParams(max_tokens=4))
    sched.add(req)
    for _ in range(rng.randint(1, 2)):  # one or two chunks computed
        _compute(sched, sched.schedule(), gen)
    stopped = req.num_computed
    assert 0 < stopped < n
    states = sched.recurrence.states
    conv = states.conv[:, req.state_slot].clone()
    ssm = states.ssm[:, req.state_slot].clone()
    sched._preempt(req)
    assert req.status is Status.WAITING and req.num_computed == 0
    batch = sched.schedule()  # readmitted: from the state where it stopped
    assert [c.request for c in batch.chunks] == [req]
    assert batch.chunks[0].start == stopped and req.resume_boundary == stopped
    assert torch.equal(states.conv[:, req.state_slot], conv)
    assert torch.equal(states.ssm[:, req.state_slot], ssm)
    _compute(sched, batch, gen)
    assert req.num_resumed == stopped and req.admissions == 2
    sched.check_integrity()


def test_waiting_admissions_count_a_resume_once(rng_seed):
    """An admission tried while the pool has no room restores nothing it counts: only the
    admission that goes through adds to the resumed tokens."""
    rng = random.Random(rng_seed)
    gen = torch.Generator().manual_seed(rng_seed)
    sched = _scheduler(n_pages=10, chunk=4 * PAGE)
    first = Request("a", [rng.randrange(3, 300) for _ in range(6 * PAGE)], SamplingParams())
    sched.add(first)
    _compute(sched, sched.schedule(), gen)
    sched._preempt(first)  # cached with a checkpoint at 4 pages
    hog = Request("b", [rng.randrange(3, 300) for _ in range(8 * PAGE)], SamplingParams())
    sched.waiting.appendleft(hog)  # admitted first, it takes every free page
    for _ in range(rng.randint(2, 4)):
        batch = sched.schedule()
        assert all(c.request is not first for c in batch.chunks)
        _compute(sched, batch, gen)
        if hog.num_computed >= hog.n_tokens:
            break
    assert first.num_resumed == 0 and first.status is Status.WAITING


def test_lone_request_without_progress_is_failed_not_retried():
    """Mode none (no checkpoints): a preempted hybrid request restarts cold. Alone, with pages
    for one chunk only, it would compute that chunk, be preempted at the same token, and again,
    forever; after MAX_FRUITLESS_PREEMPTIONS it is handed to the engine to fail."""
    gen = torch.Generator().manual_seed(0)
    sched = _scheduler(n_pages=5, chunk=4 * PAGE, mode="none")  # 4 pages + the scratch one
    req = Request("a", list(range(3, 3 + 8 * PAGE)), SamplingParams())
    sched.add(req)
    for _ in range(4 * (MAX_FRUITLESS_PREEMPTIONS + 2)):
        _compute(sched, sched.schedule(), gen)
        if sched.unservable:
            break
    [(failed, why)] = sched.take_unservable()
    assert failed is req and "cannot progress" in why and f"token {4 * PAGE}" in why
    assert req not in sched.waiting and req not in sched.running
    sched.check_integrity()


@pytest.mark.parametrize("checkpoints", ["anchors", "none"])
def test_engine_fails_a_lone_hybrid_request_that_cannot_grow(tmp_path, rng_seed, checkpoints):
    """After its first 64-token chunk, a budget cut leaves a lone 300-token request 6 pages
    (96 tokens) beside the fewest slots. It ends in a bounded number of steps with an error
    naming the problem: checkpointed where it stopped, it waits for pages and is failed as
    unschedulable; in mode none it restarts cold each time and is failed as unable to
    progress (without that, it looped forever). A short request runs afterwards."""
    make_tiny("qwen3_5_moe", tmp_path, rng_seed, max_position_embeddings=2048)
    rng = random.Random(rng_seed)
    engine = _elastic_engine(tmp_path, checkpoints)
    rid = engine.submit([rng.randrange(3, 320) for _ in range(300)],
                        SamplingParams(max_tokens=4, temperature=0))  # fmt: skip
    engine.step()
    m = engine.memory
    # The floor (fixed bytes, 2 pages, the fewest slots, a checkpoint row) and 4 pages more.
    engine.set_gpu_budget(m.floor + 4 * m.arena.kv_unit.nbytes)
    for _ in range(100):
        engine.step()
        engine.check_integrity()
        if not engine.has_unfinished():
            break
    assert not engine.has_unfinished(), "the request neither finished nor failed in 100 steps"
    out = engine._collect(rid)
    assert out.finish_reason == "error"
    want = "needs KV for 300 tokens" if checkpoints == "anchors" else "cannot progress"
    assert want in out.error, out.error
    small = [rng.randrange(3, 320) for _ in range(20)]
    assert engine.generate(small, SamplingParams(max_tokens=4)).finish_reason == "length"
    engine.check_integrity()


def test_preemptions_by_others_do_not_count_toward_failing():
    """Preempted for others (here by hand, as the memory manager or a growing neighbour
    does), a request waits its turn: only self-preemptions alone in the engine count, so its
    first one after those is not a failure."""
    gen = torch.Generator().manual_seed(1)
    sched = _scheduler(n_pages=5, chunk=4 * PAGE, mode="none")
    req = Request("a", list(range(3, 3 + 8 * PAGE)), SamplingParams())
    sched.add(req)
    for _ in range(MAX_FRUITLESS_PREEMPTIONS + 1):
        _compute(sched, sched.schedule(), gen)  # (re)admitted cold: its first chunk
        sched._preempt(req)  # at the same token each time
    _compute(sched, sched.schedule(), gen)
    # Alone, its next chunk cannot grow: it preempts itself (and, in mode none, is readmitted
    # cold in the same schedule); one fruitless self-preemption, not a failure.
    batch = sched.schedule()
    assert [(c.request, c.start) for c in batch.chunks] == [(req, 0)]
    assert sched.take_unservable() == [] and req.fruitless_preemptions == 1


def test_a_request_preempted_beside_scheduled_others_waits_for_them(rng_seed):
    """Six pages (20 tokens, the engine's max_model_len), four requests. Each newcomer is
    admitted while another decodes with the last free page, computes its first 3 tokens, and
    finds no victim but itself (the decoding one was scheduled first): it preempts itself at
    token 3, step after step, with nothing computed in between. It is not alone, so it waits
    for the other to finish and then runs; counted as alone, it was failed after four such
    steps though it fits the engine."""
    rng = random.Random(rng_seed)
    alloc = PageAllocator(6)
    sched = Scheduler(alloc, RadixCache(PAGE, alloc), PAGE, max_num_seqs=3, max_batched_tokens=4)
    shapes = [(1, 20), (13, 3), (12, 19), (14, 15)]  # (prompt tokens, max_tokens)
    max_model_len = 20
    # Disjoint token ranges: no prefix shared between requests changes the pages they take.
    reqs = [Request(f"r{i}", [rng.randrange(100 * i + 3, 100 * i + 100) for _ in range(n)],
                    SamplingParams(max_tokens=most, temperature=0))
            for i, (n, most) in enumerate(shapes)]  # fmt: skip
    for r in reqs:
        sched.add(r)
    alone_failures = []
    for _ in range(400):
        if not sched.has_work():
            break
        batch = sched.schedule()
        failed = sched.take_unservable()
        alone_failures += [(r.id, [o.id for o in sched.running]) for r, _ in failed]
        for c in batch.chunks:
            sched.advance(c)
            if c.sample:
                c.request.output_ids.append(rng.randrange(3, 100))
                if c.request.at_length(max_model_len):
                    sched.finish(c.request, "length")
        sched.check_integrity()
    assert alone_failures == []
    assert not sched.has_work() and all(r.status is Status.FINISHED for r in reqs)
    for r, (n, most) in zip(reqs, shapes, strict=True):
        assert len(r.output_ids) == min(most, max_model_len - n)
    assert max(r.fruitless_preemptions for r in reqs) == 0
    assert sched.preemptions >= 4  # the newcomers did preempt themselves beside the others


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe"])
def test_random_budget_walk_always_ends_and_matches_resident(tmp_path, rng_seed, family):
    """Several requests of random lengths (anchored, as agent turns are) while the budget
    jumps at random between the floor and the load-time budget every few steps: every request
    ends within a bounded number of steps, a finished one has the resident engine's tokens, a
    failed one says why, and every pool is intact after every step."""
    make_tiny(family, tmp_path, rng_seed, max_position_embeddings=2048)
    rng = random.Random(rng_seed)
    resident = Engine.load(tmp_path, device="cpu", progress=False, policy="resident")
    engine = _elastic_engine(tmp_path, "anchors")  # any family: hybrids also get checkpoints
    m = engine.memory
    top = m.user_budget
    sp = SamplingParams(max_tokens=rng.randint(4, 24), temperature=0, ignore_eos=True)
    prompts = [[rng.randrange(3, 320) for _ in range(rng.randint(10, 300))]
               for _ in range(rng.randint(2, 4))]  # fmt: skip
    rids = [engine.submit(p, sp, anchors=sorted(rng.sample(range(1, len(p) + 1), 2)))
            for p in prompts]  # fmt: skip
    for step in range(3000):
        if step % rng.randint(2, 6) == 0:
            engine.set_gpu_budget(rng.randint(m.floor, top))
        engine.step()
        engine.check_integrity()
        if not engine.has_unfinished():
            break
    assert not engine.has_unfinished(), f"requests still running after 3000 steps (seed {rng_seed})"
    finished = 0
    for p, rid in zip(prompts, rids, strict=True):
        out = engine._collect(rid)
        if out.finish_reason == "error":
            assert "needs KV" in out.error or "cannot progress" in out.error, out.error
        else:
            assert out.token_ids == resident.generate(p, sp).token_ids
            finished += 1
    print(f"{finished}/{len(prompts)} finished, {m.preempted + engine.scheduler.preemptions} "
          f"preemptions, {len(m.trace)} split moves")  # fmt: skip
