"""A step that fails after the expert cache filled slots (the CPU branch raising, here injected)
fails its own requests only: the cache's host maps and device table stay one picture, and later
requests decode the tokens a resident engine gives."""

from __future__ import annotations

import random

import pytest
from tiny_models import make_tiny

from freetoken_agent import Engine, SamplingParams
from freetoken_agent.engine.experts import miss_placement


@pytest.mark.parametrize("policy", ["transfer", "adaptive"])
def test_a_failed_cpu_branch_after_fills_leaves_the_cache_whole(
    tmp_path, rng_seed, monkeypatch, policy
):
    rng = random.Random(rng_seed)
    make_tiny("qwen3_moe", tmp_path, rng_seed)
    resident = Engine.load(tmp_path, device="cpu", policy="resident", progress=False)
    spec = resident.spec
    slots = rng.randint(1, max(1, spec.n_experts // 2))  # few: fills evict, misses go to the CPU
    engine = Engine.load(tmp_path, device="cpu", policy=policy, expert_slots=slots,
                         progress=False)  # fmt: skip
    cache = engine.loaded.bank.cache
    fill, real_run = cache.fill, miss_placement.run_on_cpu
    state = {"filled": False, "failed": 0}

    def recording_fill(*args, **kwargs):
        filled = fill(*args, **kwargs)
        state["filled"] = bool(filled)
        return filled

    def failing_run(*args, **kwargs):
        if state["filled"] and not state["failed"]:  # right after a fill that took slots
            state["failed"] += 1
            raise RuntimeError("injected: the CPU branch failed")
        return real_run(*args, **kwargs)

    monkeypatch.setattr(cache, "fill", recording_fill)
    monkeypatch.setattr(miss_placement, "run_on_cpu", failing_run)
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    for _ in range(20):  # until a step fails where the fault was put
        out = engine.generate([rng.randrange(3, 320) for _ in range(rng.randint(8, 60))], sp)
        if state["failed"]:
            break
    assert state["failed"] == 1, "no CPU branch ran after a fill"
    assert out.finish_reason == "error" and "injected" in out.error
    engine.check_integrity()
    prompts = [[rng.randrange(3, 320) for _ in range(rng.randint(5, 40))] for _ in range(4)]
    assert [o.token_ids for o in engine.generate(prompts, sp)] == [
        o.token_ids for o in resident.generate(prompts, sp)
    ]
    engine.check_integrity()
