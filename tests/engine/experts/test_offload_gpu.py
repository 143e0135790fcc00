"""Offloading on CUDA (device machine): every policy, slot budgets from one slot up, streamed
prefill and segmented decode graphs give the resident engine's tokens; fp32, so float noise
stays below every gap."""

from __future__ import annotations

import random

import pytest
from tiny_models import make_tiny, max_rel_err

from freetoken_agent import Engine, SamplingParams
from freetoken_agent.engine.direct_graphs import DirectDecodeGraphs
from freetoken_agent.engine.path_graphs import PathDecodeGraphs
from freetoken_agent.engine.segmented_graphs import SegmentedDecodeGraphs

pytestmark = pytest.mark.gpu


CUDA = dict(device="cuda", progress=False, max_model_len=512, max_num_seqs=4)


def _resident_run(tmp_path, rng_seed: int, max_tokens: int):
    """A tiny 16-expert top-4 model in `tmp_path`, two prompts and the resident engine's greedy
    tokens for them: (prompts, sampling params, tokens)."""
    make_tiny("qwen3_moe", tmp_path, rng_seed, num_experts=16, num_experts_per_tok=4)
    rng = random.Random(rng_seed)
    prompts = [[rng.randrange(3, 320) for _ in range(n)] for n in (9, 40)]
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    resident = Engine.load(tmp_path, policy="resident", **CUDA)
    return prompts, sp, [o.token_ids for o in resident.generate(prompts, sp)]


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
        for p in ("transfer", "cpu", "static", "adaptive", "direct", "gpu-fill")
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
        if policy == "adaptive":  # its paths in turn, two steps each (it warms on device)
            engine.loaded.bank.adaptive.path_params = dict(block=2, rotations=1, period=0, warm=0)
        got = [o.token_ids for o in engine.generate(prompts, sp)]
        assert got == want, (policy, slots, double_buffer)
        graphs = engine.runner.graphs
        if policy == "direct":  # one graph a step; misses read from the pinned pool
            assert isinstance(graphs, DirectDecodeGraphs)
            # (all but one expert resident: decode may route to residents only)
            assert engine.stats()["experts"]["direct"] > 0 or slots == rows - 1
        elif policy == "gpu-fill":  # one graph a step; its layers fill their own misses
            assert isinstance(graphs, DirectDecodeGraphs)
            st = engine.stats()["experts"]
            assert st["fetched"] > 0 or slots == rows - 1
            assert st["direct"] > 0 or slots > 1  # one slot: the layer's second expert
        else:  # adaptive: both paths' graphs (path_graphs.py)
            want_type = PathDecodeGraphs if policy == "adaptive" else SegmentedDecodeGraphs
            assert isinstance(graphs, want_type)
        if slots == 1 and policy not in ("direct", "gpu-fill"):  # layers missed: segments re-ran
            assert graphs.reruns > 0, policy
        assert max_rel_err(engine.score(ids), want_logits) <= 1e-4
        engine.check_integrity()
        st = engine.stats()["experts"]
        assert st["placement"] == "offloaded" and st["layers_streamed"] > 0


def test_adaptive_split_modes_on_cuda_match_resident(tmp_path, rng_seed):
    """adaptive under segmented decode graphs, its fill race held in the neutral band and its
    split mode switching every decode step (q*, all, none, whole layers: the layers mode's
    bulk fill runs inside a graph step), gives the resident engine's tokens."""
    rng = random.Random(rng_seed)
    prompts, sp, want = _resident_run(tmp_path, rng_seed, max_tokens=24)
    slots = 16 + rng.randrange(1, 16)  # one whole layer and some to spare
    engine = Engine.load(tmp_path, policy="adaptive", expert_slots=slots, **CUDA)
    bank = engine.loaded.bank
    assert isinstance(engine.runner.graphs, PathDecodeGraphs)
    bank.adaptive.path_params = {"fixed": "stops"}  # the stops path's split modes
    bank.adaptive.trial_params = dict(block=1, rotations=1, period=0)
    # Every mode runs, `layers` too: its gate (layers_may_pay, tested on the CPU) refuses it
    # where decode steps stop at few layers, as some seeds' did on the device (seed
    # 1311268990, fourteenth session).
    bank.adaptive.layers_may_pay = lambda n: True
    ids = [engine.submit(p, sp) for p in prompts]
    modes = set()
    while engine.has_unfinished():
        bank.cache.fill_gain = 0.0  # in band: the trials choose
        modes |= {t.mode for t in bank.adaptive._trials.values()}
        engine.step()
    assert [engine._collect(i).token_ids for i in ids] == want
    assert modes == {"split", "all", "none", "layers"}
    engine.check_integrity()


def test_fills_behind_on_cuda_match_resident(tmp_path, rng_seed):
    """EngineConfig.fill_behind under segmented decode graphs, fills paying: fills left in
    flight on the copy stream while the step goes on, reruns of segments that read the table
    before they settled, and the last step's settled before the next begins; the resident
    engine's tokens."""
    prompts, sp, want = _resident_run(tmp_path, rng_seed, max_tokens=32)
    engine = Engine.load(tmp_path, policy="adaptive", expert_slots=20, fill_behind=True, **CUDA)
    bank = engine.loaded.bank
    assert isinstance(engine.runner.graphs, PathDecodeGraphs)
    bank.adaptive.path_params = {"fixed": "stops"}  # fills behind are the stops path's
    bank.adaptive.verdict = lambda gain: "all"  # fills pay: every miss is filled
    assert [o.token_ids for o in engine.generate(prompts, sp)] == want
    assert bank.stats.behind > 0
    engine.check_integrity()


@pytest.mark.parametrize("overlap", [False, True])
def test_adaptive_alternating_step_paths_on_cuda_match_resident(tmp_path, rng_seed, overlap):
    """adaptive switching every two decode steps between the segmented graphs (the host's
    stops) and the whole-step graph whose layers fill their own misses (step_paths.py), with
    the cache handed between host and device at each switch: the resident engine's tokens."""
    rng = random.Random(rng_seed)
    prompts, sp, want = _resident_run(tmp_path, rng_seed, max_tokens=24)
    opts = {**CUDA, "overlap_schedule": overlap}
    engine = Engine.load(tmp_path, policy="adaptive", expert_slots=rng.randint(5, 30), **opts)
    bank, graphs = engine.loaded.bank, engine.runner.graphs
    assert isinstance(graphs, PathDecodeGraphs)
    bank.adaptive.path_params = dict(block=2, rotations=1, period=0, warm=0)
    bank.adaptive.verdict = lambda gain: "all"  # fills pay: no split trials hold the path
    assert [o.token_ids for o in engine.generate(prompts, sp)] == want
    assert graphs.device_steps > 0 and graphs.missed_layers > 0  # both paths ran
    assert bank.cache.on_device.releases >= 2
    engine.check_integrity()


def test_adaptive_with_more_sequences_than_the_device_path_holds(tmp_path, rng_seed):
    """At top-8 the device path's graphs hold 16 sequences (the kernels read the pool for 128
    pairs at most); the default 32 still loads, and a batch past 16 takes the stops path."""
    make_tiny("qwen3_moe", tmp_path, rng_seed, num_experts=16, num_experts_per_tok=8)
    rng = random.Random(rng_seed)
    prompts = [[rng.randrange(3, 320) for _ in range(rng.randint(3, 12))] for _ in range(20)]
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    opts = dict(device="cuda", progress=False, max_model_len=256)  # max_num_seqs: default 32
    want = [o.token_ids for o in Engine.load(tmp_path, policy="resident", **opts).generate(
        prompts, sp)]  # fmt: skip
    # Two MoE layers of 16 experts: 32 slots would hold them all, and the engine then loads a
    # resident bank (no device paths to test).
    engine = Engine.load(tmp_path, policy="adaptive", expert_slots=rng.randint(20, 31), **opts)
    graphs = engine.runner.graphs
    assert isinstance(graphs, PathDecodeGraphs) and graphs.device.sizes[-1] == 16
    assert graphs.stops.sizes[-1] == engine.config.max_num_seqs
    assert [o.token_ids for o in engine.generate(prompts, sp)] == want
    engine.check_integrity()


@pytest.mark.parametrize("overlap", [False, True])
def test_adaptive_shared_path_on_cuda_matches_resident(tmp_path, rng_seed, overlap):
    """adaptive's `shared` path held: the whole-step graph's layers post the CPU worker its
    share of their misses (pinned mailbox, system-scope ordering) and collect its answer in
    the MoE sum over k; at one slot (every miss to the CPU), a random budget and share, and all
    but one slot: the resident engine's tokens and logits."""
    from freetoken_agent.kernels.cpu import worker

    if not worker.available():
        pytest.fail("the device image has no C++ compiler: the CPU expert kernel did not build")
    rng = random.Random(rng_seed)
    prompts, sp, want = _resident_run(tmp_path, rng_seed, max_tokens=20)
    resident = Engine.load(tmp_path, policy="resident", **CUDA)
    ids = prompts[1] + want[1]
    want_logits = resident.score(ids)
    rows = resident.spec.n_moe_layers * resident.spec.n_experts
    opts = {**CUDA, "overlap_schedule": overlap}
    for slots, fraction in ((1, 1.0), (rng.randint(5, rows - 2), rng.uniform(0.4, 0.8)),
                            (rows - 1, 0.5)):  # fmt: skip
        engine = Engine.load(tmp_path, policy="adaptive", expert_slots=slots, **opts)
        bank, graphs = engine.loaded.bank, engine.runner.graphs
        assert isinstance(graphs, PathDecodeGraphs) and bank.cpu_share is not None
        # the post and the answer are in the shared set's graphs only (path_graphs.py)
        assert graphs.shared is not None and graphs.shared.cpu_share
        assert not graphs.device.cpu_share
        bank.adaptive.path_params = {"fixed": "shared"}
        bank.adaptive.shared_gate = False  # the path itself, not when adaptive allows it
        bank.bandwidths.cpu, bank.bandwidths.pcie = fraction, 1.0 - fraction + 1e-9
        bank.cpu_share.observe = lambda bandwidths: None  # keep the share set here
        # Held: the share trials move it by up to 0.3 (share_trials.py), and at 0.1 a layer's
        # two or three misses round to none for the CPU (likely why one H200 run, its share
        # drawn from 0.2, ran no job).
        bank.adaptive.held_share = fraction
        assert [o.token_ids for o in engine.generate(prompts, sp)] == want, (slots, fraction)
        assert graphs.device_steps > 0
        st = engine.stats()["experts"]
        if slots < rows // 2:
            assert st["cpu_share"]["jobs"] > 0 and st["on_cpu"] > 0
        assert st["cpu_share"]["broken"] is None
        assert max_rel_err(engine.score(ids), want_logits) <= 1e-4
        engine.check_integrity()
        engine.close()
