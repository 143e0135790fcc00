"""Seeded requests under overlap scheduling: a request that a stop ends while its next step is
already launched leaves no generator behind, and a request id used again draws as a fresh
request with that seed does."""

from __future__ import annotations

import random

from tiny_models import make_tiny

from freetoken_agent import Engine, SamplingParams


def test_stopped_seeded_requests_leave_no_generator(tmp_path, rng_seed):
    rng = random.Random(rng_seed)
    make_tiny("qwen3_moe", tmp_path, rng_seed)
    engine = Engine.load(tmp_path, device="cpu", progress=False, overlap_schedule=True)

    def run(rid: str, prompt: list[int], sp: SamplingParams) -> list[int]:
        engine.submit(prompt, sp, request_id=rid)
        while engine.has_unfinished():
            engine.step()
        tokens = list(engine._requests[rid].output_ids)
        engine._pop(rid)
        return tokens

    stopped = 0
    for i in range(6):
        prompt = [rng.randrange(3, 320) for _ in range(rng.randint(4, 20))]
        seed = rng.getrandbits(31)
        sp = SamplingParams(max_tokens=12, temperature=1.0, seed=seed, ignore_eos=True)
        fresh = run(f"fresh-{i}", prompt, sp)
        cut = rng.randrange(2, 10)  # stop at a token whose first time is there
        while fresh[cut] in fresh[:cut]:
            cut -= 1
        stop = SamplingParams(max_tokens=12, temperature=1.0, seed=seed, ignore_eos=True,
                              stop_token_ids=[fresh[cut]])  # fmt: skip
        stopped += len(run("reused", prompt, stop)) == cut + 1
        assert run("reused", prompt, sp) == fresh  # the id again: drawn as a fresh request
    assert stopped == 6
    assert engine.runner._generators == {}
