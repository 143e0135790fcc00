"""EngineConfig.fill_behind on a whole engine: decode steps that fill some misses behind
their compute give the resident engine's tokens (the graph protocol's side is in
test_graph_decisions.py)."""

import random

import pytest
from tiny_models import make_tiny

from freetoken_agent import Engine, SamplingParams


@pytest.mark.parametrize("fill_behind", [False, True])
def test_decode_with_fills_behind_matches_resident(tmp_path, rng_seed, fill_behind):
    make_tiny("qwen3_moe", tmp_path, rng_seed, num_experts=16, num_experts_per_tok=4)
    rng = random.Random(rng_seed)
    prompts = [[rng.randrange(3, 320) for _ in range(rng.randint(4, 30))] for _ in range(3)]
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    resident = Engine.load(tmp_path, device="cpu", policy="resident", progress=False)
    want = [o.token_ids for o in resident.generate(prompts, sp)]
    engine = Engine.load(tmp_path, device="cpu", policy="adaptive", expert_slots=20,
                         fill_behind=fill_behind, progress=False)  # fmt: skip
    bank = engine.loaded.bank
    bank.adaptive.verdict = lambda gain: "all"  # fills pay: every miss is filled
    bank.adaptive.path_params = {"fixed": "stops"}  # fills behind are the stops path's
    assert [o.token_ids for o in engine.generate(prompts, sp)] == want
    engine.check_integrity()
    # Only the flag fills behind; either way every miss of a decode step is filled.
    assert (bank.stats.behind > 0) == fill_behind
    assert bank.stats.fetched > 0
