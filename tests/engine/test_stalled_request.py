"""A waiting request that no step can admit gets one more safe point before it is failed
(`Engine._unschedulable`). That try is per stall: a request that stalled once, then ran, and
stalls again later (preempted by a budget cut) gets it again. The engine remembered the first
stall for ever and failed the second one at once."""

from __future__ import annotations

import random

from freetoken_agent import Engine, SamplingParams
from freetoken_agent.demo_model import ensure_demo_model
from freetoken_agent.engine.request import Batch


def test_a_later_stall_gets_its_one_more_try_again(tmp_path, rng_seed, monkeypatch):
    rng = random.Random(rng_seed)
    engine = Engine.load(ensure_demo_model(tmp_path), device="cpu", progress=False,
                         overlap_schedule=False)  # fmt: skip
    prompt = [rng.randrange(3, 1000) for _ in range(rng.randint(4, 40))]
    sp = SamplingParams(max_tokens=rng.randint(6, 12), temperature=0, ignore_eos=True)
    want = engine.generate(prompt, sp).token_ids
    sched, real = engine.scheduler, engine.scheduler.schedule

    def stall() -> list:
        """One step in which nothing can be admitted (as under a budget cut)."""
        monkeypatch.setattr(sched, "schedule", lambda: Batch([]))
        events = engine.step()
        monkeypatch.setattr(sched, "schedule", real)
        return events

    rid = engine.submit(prompt, sp)
    assert stall() == []  # the first stall: one more try
    for _ in range(rng.randint(1, 3)):  # admitted, it prefills and decodes
        assert not any(e.finished for e in engine.step())
    req = sched.running[0]
    sched._preempt(req)  # a budget cut puts it back to waiting, alone in the engine
    assert stall() == []  # a new stall: one more try again (it was failed here)
    while engine.has_unfinished():
        engine.step()
    out = engine._collect(rid)
    assert out.error is None and out.token_ids == want
