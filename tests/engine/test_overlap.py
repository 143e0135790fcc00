"""Overlap scheduling (engine/overlap.py): decode step N launched before N-1's tokens are read.

Every test drives two engines over the same model, overlap off and on, through the same
submissions at the same calls, and holds them to the same tokens, events and finish reasons;
each also checks that the overlapped engine really launched lagged steps (or, where it must
not, that it did not), and the engine's integrity after every call (a step in flight included).
"""

from __future__ import annotations

import random

import pytest
from elastic_engines import elastic_engine
from overlap_runs import Events, Plan, both_loops
from tiny_models import make_tiny

from freetoken_agent import Engine, SamplingParams
from freetoken_agent.engine.request import Status


def _load(path, overlap: bool, **options) -> Engine:
    """float64: a lagged step's dropped rows change the batch's shape, which in float32 may
    flip a near-tied router or token choice of another row."""
    options.setdefault("kv_tokens", 4096)
    options.setdefault("dtype", "float64")
    return Engine.load(path, device="cpu", progress=False, overlap_schedule=overlap, **options)


def both(path, plan: Plan, **options) -> tuple[Events, Engine]:
    """The events of both loops (they must agree) and the overlapped engine."""
    return both_loops(lambda overlap: _load(path, overlap, **options), plan)


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 320) for _ in range(n)]


@pytest.fixture
def model_dir(tmp_path, rng_seed):
    make_tiny("qwen3_moe", tmp_path, rng_seed)
    return tmp_path


def test_batch_ending_by_length_and_by_stop(model_dir, rng_seed):
    """Requests end at different steps, by length (left out of the lagged step) and by stop
    tokens (their lagged row dropped), while the others go on."""
    rng = random.Random(rng_seed)
    prompts = [_prompt(rng, rng.randint(5, 40)) for _ in range(4)]
    free = _load(model_dir, False).generate(
        prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    )
    plan = {0: []}
    for i, (p, out) in enumerate(zip(prompts, free, strict=True)):
        if i % 2:  # stop at a token it generates mid-way
            stop = out.token_ids[rng.randint(3, 12)]
            sp = SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[stop])
        else:
            # At least 13: the batch is the same until every stop token is reached.
            sp = SamplingParams(max_tokens=rng.randint(13, 24), temperature=0, ignore_eos=True)
        plan[0].append((p, sp, {}))
    events, engine = both(model_dir, plan)
    reasons = {evs[-1][4] for evs in events.values()}
    assert reasons == {"stop", "length"}
    assert engine.overlap.lagged_steps >= 10
    assert engine.kv.allocator.n_free + len(engine.radix.pages()) == engine.kv.allocator.capacity


def test_seeded_sampling_and_arrivals_mid_decode(model_dir, rng_seed):
    """Seeded top-p/top-k sampling gives the same tokens; requests arriving while others
    decode drain the step in flight, prefill, and the batch overlaps again."""
    rng = random.Random(rng_seed)
    plan: Plan = {}
    for k in range(5):
        at = 0 if k == 0 else rng.randint(1, 30)
        sp = SamplingParams(max_tokens=rng.randint(8, 30), temperature=rng.choice([0, 0.8, 1.2]),
                            top_p=rng.choice([1.0, 0.9]), top_k=rng.choice([0, 20]),
                            seed=rng.randrange(1 << 30), ignore_eos=True)  # fmt: skip
        plan.setdefault(at, []).append((_prompt(rng, rng.randint(3, 50)), sp, {}))
    events, engine = both(model_dir, plan, max_batched_tokens=32)
    assert len(events) == 5
    st = engine.stats()["overlap"]
    assert st["enabled"] and st["lagged_steps"] >= 10 and st["drains"] >= 1


def test_abort_with_a_step_in_flight(model_dir, rng_seed):
    rng = random.Random(rng_seed)
    engine = _load(model_dir, True)
    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    keep, drop = engine.submit(_prompt(rng, 20), sp), engine.submit(_prompt(rng, 30), sp)
    for _ in range(rng.randint(4, 10)):
        engine.step()
    assert engine.overlap.inflight is not None
    engine.abort(drop)  # its row of the step in flight is dropped
    engine.check_integrity()
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
    out = [e.token_id for e in engine._events[keep]]
    alone = _load(model_dir, False).generate(engine._requests[keep].prompt_ids, sp)
    assert out == alone.token_ids
    assert engine._events[drop][-1].finish_reason == "abort"
    assert engine._requests[drop].status is Status.FINISHED


def test_model_length_and_a_dry_pool(tmp_path, rng_seed):
    """A request reaching the model's length ends there; a KV pool too small for every
    request's next page drains and preempts as the plain loop does (float64: a re-prefill
    after preemption computes exactly what decode did)."""
    make_tiny("qwen3_moe", tmp_path, rng_seed, max_position_embeddings=96)
    rng = random.Random(rng_seed)
    sp = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    plan = {0: [(_prompt(rng, rng.randint(40, 80)), sp, {}) for _ in range(3)]}
    events, engine = both(tmp_path, plan, kv_tokens=160, page_size=16)
    assert {evs[-1][4] for evs in events.values()} == {"length"}
    assert engine.scheduler.preemptions >= 1 and engine.overlap.lagged_steps >= 5
    assert engine.overlap.inflight is None  # the length was known: no step ran past it


@pytest.mark.parametrize("policy", ["adaptive", "transfer", "cpu", "gpu-fill"])
def test_offloaded_bank(tmp_path, rng_seed, policy):
    """An offloaded bank with a few slots: the same tokens as the plain loop and as resident;
    adaptive's split trials are told each overlapped step's time."""
    make_tiny("qwen3_moe", tmp_path, rng_seed)
    rng = random.Random(rng_seed)
    sp = SamplingParams(max_tokens=rng.randint(10, 20), temperature=0, ignore_eos=True)
    prompts = [_prompt(rng, rng.randint(5, 30)) for _ in range(2)]
    plan = {0: [(p, sp, {}) for p in prompts]}
    timed: list[tuple[int, float]] = []
    # float32: the CPU expert kernel has no float64; the batches are the same in both loops
    # (no request ends early, so no row is dropped).
    options = {"policy": policy, "expert_slots": rng.randint(6, 20), "dtype": "float32"}
    events, engine = both(tmp_path, plan, **options)
    resident = _load(tmp_path, False, policy="resident", dtype="float32").generate(prompts, sp)
    assert [[e[1] for e in evs] for evs in events.values()] == [o.token_ids for o in resident]
    engine.runner.on_decode_step = lambda n, s: timed.append((n, s))
    engine.generate(prompts, sp)
    assert engine.overlap.inflight is None  # their length was known: no step ran past it
    assert engine.overlap.lagged_steps >= 2 * (sp.max_tokens - 3)
    assert len(timed) >= sp.max_tokens - 2 and all(n == 2 and s > 0 for n, s in timed)


def test_hybrid_checkpoints_at_decode(tmp_path, rng_seed):
    """A hybrid model: a decode checkpoint the accept of a token may take holds the state
    before the next step, which overlap has launched by then, so it is taken ahead. Anchors
    mode: kept when the token is an anchor token (an edited history diverging there resumes
    from it), released otherwise; positional mode: at each boundary. Both loops resume the
    follow-up turn from the same decode checkpoint and decode as a cold engine does."""
    make_tiny("qwen3_next", tmp_path, rng_seed)
    rng = random.Random(rng_seed)
    prompt = _prompt(rng, rng.randint(20, 30))
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    free = _load(tmp_path, False).generate(prompt, sp)
    # The anchor: a token generated at 3..12 whose first appearance is past the first token
    # (one the model also generated first would checkpoint at the prompt's end, not while
    # decoding; a random tiny model repeats itself).
    tokens = free.token_ids
    later = [i for i in range(1, len(tokens)) if tokens.index(tokens[i]) >= 1]
    assert later, f"the model generated one token only: {tokens}"
    at = rng.choice([i for i in later if 3 <= i <= 12] or later)
    anchor = tokens[at]
    first = tokens.index(anchor)  # the first time it is generated
    every = rng.choice([5, 6, 7])
    cases = [
        # anchors: the follow-up keeps the answer up to the anchor, then diverges there
        ("anchors", {"anchor_tokens": [anchor]}, prompt + free.token_ids[:first]
         + _prompt(rng, 7), len(prompt) + first),
        ("positional", {}, prompt + free.token_ids + _prompt(rng, 7),
         (len(prompt) + sp.max_tokens - 1) // every * every),
    ]  # fmt: skip
    for mode, options, follow, deepest in cases:
        checkpoints = "anchors" if mode == "anchors" else f"positional:{every}"
        assert deepest > len(prompt)  # a checkpoint taken while decoding
        outs, held = [], []
        for overlap in (False, True):
            engine = _load(tmp_path, overlap, checkpoints=checkpoints)
            assert engine.generate(prompt, sp, **options).token_ids == free.token_ids
            if overlap:
                assert engine.overlap.lagged_steps >= sp.max_tokens - 3, mode
            outs.append(engine.generate(follow, sp))
            engine.check_integrity()
            # Idle: every checkpoint left is hung on the tree (none taken ahead leaked).
            rows = engine.loaded.recurrence.checkpoints._rows.values()
            live = [c for tier in rows for c in tier if c is not None]
            assert all(c.owner is not None for c in live)
            held.append(sorted(c.boundary for c in live))
        assert held[0] == held[1], mode  # the same checkpoints, none kept at a non-anchor
        assert [o.stats["resumed_tokens"] for o in outs] == [deepest, deepest], mode
        cold = _load(tmp_path, False, checkpoints="none").generate(follow, sp)
        assert outs[0].token_ids == outs[1].token_ids == cold.token_ids, mode


def test_hybrid_failed_read_releases_the_checkpoints_taken_ahead(tmp_path, rng_seed):
    """Hybrid requests with anchor tokens whose step in flight cannot be read back (a device
    fault): they fail with the error, and the checkpoints taken ahead for their unread tokens
    go back to the pool, not into the tree; the engine serves the next request."""
    make_tiny("qwen3_next", tmp_path, rng_seed)
    rng = random.Random(rng_seed)
    engine = _load(tmp_path, True, checkpoints="anchors")
    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    anchors = {"anchor_tokens": [rng.randrange(3, 320) for _ in range(3)]}
    rids = [engine.submit(_prompt(rng, n), sp, **anchors) for n in (20, 25)]
    for _ in range(rng.randint(4, 10)):
        engine.step()

    class Unreadable:
        def tolist(self):
            raise RuntimeError("injected read failure")

    engine.overlap.inflight.host = Unreadable()
    engine.step()  # schedules the next step (taking checkpoints ahead), then fails the read
    while engine.has_unfinished():
        engine.step()
    ends = [engine._events[r][-1] for r in rids]
    assert all(e.finish_reason == "error" and "injected" in e.error for e in ends)
    engine.overlap.drain()
    engine.check_integrity()
    rows = engine.loaded.recurrence.checkpoints._rows.values()
    assert all(c.owner is not None for tier in rows for c in tier if c is not None)
    prompt = _prompt(rng, 15)
    short = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    cold = _load(tmp_path, False, checkpoints="none").generate(prompt, short)
    assert engine.generate(prompt, short).token_ids == cold.token_ids


def test_elastic_budget_change_drains(tmp_path, rng_seed):
    """An elastic engine: a budget cut mid-decode is applied at a safe point with nothing in
    flight (the quiet point refuses it), and the tokens are the plain loop's."""
    make_tiny("qwen3_moe", tmp_path, rng_seed)
    rng = random.Random(rng_seed)
    sp = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    prompts = [_prompt(rng, rng.randint(10, 40)) for _ in range(2)]
    cut_at = rng.randint(3, 12)
    outs = []
    for overlap in (False, True):
        engine = elastic_engine(tmp_path, "anchors")
        engine.overlap.enabled = overlap
        rids = [engine.submit(p, sp) for p in prompts]
        for call in range(200):
            if call == cut_at:
                top = engine.memory.budget
                engine.set_gpu_budget(engine.memory.floor + (top - engine.memory.floor) // 3)
            applied = engine.memory.steps
            engine.step()
            engine.check_integrity()
            assert engine.memory.held_bytes() <= engine.memory.budget or applied == 0
            if not engine.has_unfinished():
                break
        outs.append([[e.token_id for e in engine._events[r]] for r in rids])
        if overlap:
            assert engine.overlap.lagged_steps >= 10 and engine.overlap.drains >= 1
    assert outs[0] == outs[1]


@pytest.mark.parametrize("after", [False, True])
def test_a_failing_lagged_step_fails_its_requests_only(model_dir, rng_seed, monkeypatch, after):
    """A lagged launch that raises (after completing the step in flight, or before) ends the
    requests of both steps with an error event, never a hang; the engine serves the next."""
    rng = random.Random(rng_seed)
    engine = _load(model_dir, True)
    sp = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    short = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    rids = [engine.submit(_prompt(rng, 15), sp), engine.submit(_prompt(rng, 25), sp),
            engine.submit(_prompt(rng, 10), short)]  # fmt: skip
    # The second lagged call reads the short request's last token and fails to launch, before
    # or after reading it: the step before still counts either way.
    launch, fail_at = engine.runner.launch, 2
    calls = 0

    def flaky(batch, device_ids=None, between=None):
        nonlocal calls
        calls += device_ids is not None
        if calls == fail_at:
            if after and between is not None:
                between()
            raise RuntimeError("injected launch failure")
        return launch(batch, device_ids, between)

    monkeypatch.setattr(engine.runner, "launch", flaky)
    for _ in range(100):
        engine.step()
        engine.check_integrity()
        if not engine.has_unfinished():
            break
    assert not engine.has_unfinished()
    ends = [engine._events[r][-1] for r in rids]
    assert [e.finish_reason for e in ends[:2]] == ["error", "error"]
    assert all("injected launch failure" in e.error for e in ends[:2])
    assert ends[2].finish_reason == "length"
    assert len(engine._events[rids[2]]) == 3
    monkeypatch.setattr(engine.runner, "launch", launch)
    prompt = _prompt(rng, 12)
    again = engine.generate(prompt, short).token_ids
    assert again == _load(model_dir, False).generate(prompt, short).token_ids


def test_elastic_decisions_taken_in_flight(tmp_path, rng_seed):
    """A long answer crosses into a new page of lookahead every page_size tokens, which calls
    for a full memory decision; one that moves nothing is taken with the step in flight, so a
    long decode drains only where it ends, and counts a safe point a call as the plain loop
    (one call more: the last only reads the last step). Within the 512 tokens of KV."""
    make_tiny("qwen3_moe", tmp_path, rng_seed)
    rng = random.Random(rng_seed)
    prompt = _prompt(rng, rng.randint(10, 40))
    sp = SamplingParams(max_tokens=rng.randint(300, 460), temperature=0, ignore_eos=True)
    assert len(prompt) + sp.max_tokens < 512
    runs = []
    for overlap in (False, True):
        engine = elastic_engine(tmp_path, "anchors")
        engine.overlap.enabled = overlap
        runs.append((engine.generate(prompt, sp).token_ids, engine.memory.steps))
        engine.check_integrity()
    assert runs[0][0] == runs[1][0] and runs[1][1] == runs[0][1] + 1
    assert engine.overlap.drains == 1 and engine.overlap.lagged_steps == sp.max_tokens - 2
    assert len(engine.memory.trace.records) == 1  # nothing moved: the load's split only


def test_hybrid_elastic_session_overlaps(tmp_path, rng_seed):
    """A hybrid model under an elastic budget, a request with many anchor tokens (about one
    in ten generated tokens is one): checkpoints taken ahead do not count against the memory's
    steady state, so most steps overlap (each kept checkpoint may move the checkpoint tier:
    a drain), and the tokens and the checkpoints kept are the plain loop's."""
    make_tiny("qwen3_next", tmp_path, rng_seed)
    rng = random.Random(rng_seed)
    prompt = _prompt(rng, rng.randint(20, 40))
    sp = SamplingParams(max_tokens=rng.randint(80, 120), temperature=0, ignore_eos=True)
    anchor_tokens = rng.sample(range(3, 320), 32)
    runs = []
    for overlap in (False, True):
        engine = elastic_engine(tmp_path, "anchors")
        engine.overlap.enabled = overlap
        out = engine.generate(prompt, sp, anchor_tokens=anchor_tokens)
        engine.check_integrity()
        rows = engine.loaded.recurrence.checkpoints._rows.values()
        live = [c for tier in rows for c in tier if c is not None]
        assert all(c.owner is not None for c in live)
        runs.append((out.token_ids, sorted(c.boundary for c in live)))
    assert runs[0] == runs[1]
    hits = sum(t in anchor_tokens for t in runs[1][0][:-1])
    st = engine.stats()["overlap"]
    assert st["lagged_steps"] >= sp.max_tokens - 3 - 2 * hits and st["drains"] <= hits + 2


@pytest.mark.parametrize("requests, host_rows", [(2, 0), (3, 1)])
def test_hybrid_checkpoints_taken_ahead_may_be_dropped_for_space(tmp_path, rng_seed, requests,
                                                                 host_rows):  # fmt: skip
    """One device checkpoint row (a budget cut can leave that), no host row or one: each
    request's checkpoint taken ahead evicts the one before, dropping it. A dropped one is
    forgotten, as a dropped pending one is: every request ends with its cold tokens. Its
    release raised (the checkpoint 'was dropped or released') and failed the requests."""
    make_tiny("qwen3_5_moe", tmp_path, rng_seed)
    rng = random.Random(rng_seed)
    per = _load(tmp_path, True).stats()["checkpoints"]["bytes_per_checkpoint"]
    engine = _load(tmp_path, True, checkpoints="anchors", checkpoint_device_bytes=per,
                   checkpoint_host_bytes=host_rows * per)  # fmt: skip
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = [_prompt(rng, rng.randint(20, 40)) for _ in range(requests)]
    anchors = [rng.randrange(3, 320) for _ in range(3)]
    outs = engine.generate(prompts, sp, anchor_tokens=anchors)
    cold = _load(tmp_path, False, checkpoints="none")
    assert [o.error for o in outs] == [None] * requests
    assert [o.token_ids for o in outs] == [cold.generate(p, sp).token_ids for p in prompts]
    assert engine.stats()["checkpoints"]["dropped"] > 0  # the case this test is about
    engine.check_integrity()


def test_a_positional_checkpoint_not_taken_ahead_is_taken_before_the_next_step(
    tmp_path, rng_seed, monkeypatch
):
    """Positional mode: when no checkpoint row is free as the next step is scheduled (here
    every reserve made while taking checkpoints ahead fails), the step is not overlapped, so
    the accept's own checkpoint holds the state at its boundary. Overlapped, the accept took
    it after the next step had run: a checkpoint one token ahead of its boundary, and the
    follow-up resumed from it decoded wrong tokens."""
    make_tiny("qwen3_next", tmp_path, rng_seed)
    rng = random.Random(rng_seed)
    every = rng.choice([5, 6, 7])
    engine = _load(tmp_path, True, checkpoints=f"positional:{every}")
    sched, pool = engine.scheduler, engine.loaded.recurrence.checkpoints
    ahead, reserve = sched.ahead.checkpoint_ahead, pool.reserve
    taking_ahead = []

    def checkpoint_ahead(req):
        taking_ahead.append(True)
        try:
            return ahead(req)
        finally:
            taking_ahead.pop()

    monkeypatch.setattr(sched.ahead, "checkpoint_ahead", checkpoint_ahead)
    monkeypatch.setattr(pool, "reserve", lambda *a, **k: None if taking_ahead else reserve(*a, **k))
    prompt = _prompt(rng, rng.randint(20, 30))
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    out = engine.generate(prompt, sp)
    follow = prompt + out.token_ids + _prompt(rng, 7)
    again = engine.generate(follow, sp)
    deepest = (len(prompt) + sp.max_tokens - 1) // every * every
    assert again.stats["resumed_tokens"] == deepest > len(prompt)
    cold = _load(tmp_path, False, checkpoints="none")
    assert out.token_ids == cold.generate(prompt, sp).token_ids
    assert again.token_ids == cold.generate(follow, sp).token_ids
    engine.check_integrity()
