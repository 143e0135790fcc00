"""Offloading on CUDA (device machine): every policy, slot budgets from one slot up, streamed
prefill and segmented decode graphs give the resident engine's tokens; fp32, so float noise
stays below every gap."""

from __future__ import annotations

import random

import pytest
from tiny_models import make_tiny, max_rel_err

from freetoken_agent import Engine, SamplingParams
from freetoken_agent.engine.direct_graphs import DirectDecodeGraphs
from freetoken_agent.engine.segmented_graphs import SegmentedDecodeGraphs

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_offloaded_on_cuda_matches_resident(family, tmp_path, rng_seed):
    make_tiny(family, tmp_path, rng_seed)
    rng = random.Random(rng_seed)
    prompts = [[rng.randrange(3, 320) for _ in range(n)] for n in (7, 50, 300)]
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    opts = dict(device="cuda", progress=False, max_model_len=1024, max_num_seqs=4)
    resident = Engine.load(tmp_path, policy="resident", **opts)
    want = [o.token_ids for o in resident.generate(prompts, sp)]
    ids = prompts[2] + want[2]
    want_logits = resident.score(ids)
    rows = resident.spec.n_moe_layers * resident.spec.n_experts  # with `rows` slots adaptive
    cases = [  # would keep every expert resident: one fewer keeps it offloaded
        (p, s, d)
        for p in ("transfer", "cpu", "static", "adaptive", "direct")
        for s, d in ((1, True), (5, True), (5, False), (rows - 1, True))
    ]
    for policy, slots, double_buffer in cases:
        engine = Engine.load(
            tmp_path,
            policy=policy,
            expert_slots=slots,
            stream_min_tokens=128,  # the 300-token prompt streams, the others do not
            double_buffer=double_buffer,
            **opts,
        )
        got = [o.token_ids for o in engine.generate(prompts, sp)]
        assert got == want, (policy, slots, double_buffer)
        graphs = engine.runner.graphs
        if policy == "direct":  # one graph a step; misses read from the pinned pool
            assert isinstance(graphs, DirectDecodeGraphs)
            # (all but one expert resident: decode may route to residents only)
            assert engine.stats()["experts"]["direct"] > 0 or slots == rows - 1
        else:
            assert isinstance(graphs, SegmentedDecodeGraphs)
        if slots == 1 and policy != "direct":  # every layer misses: segments ran again
            assert graphs.reruns > 0, policy
        assert max_rel_err(engine.score(ids), want_logits) <= 1e-4
        engine.check_integrity()
        st = engine.stats()["experts"]
        assert st["placement"] == "offloaded" and st["layers_streamed"] > 0
