"""adaptive's `split` path on CUDA (device machine): the split set's captured layers cut each
fill between the copy kernel and the CPU worker, whose copies behind land through the copy
engines (libcuda from the worker thread); held, and alternating with the other paths every two
steps, it gives the resident engine's tokens and logits; fp32, so float noise stays below
every gap."""

from __future__ import annotations

import random

import pytest
from tiny_models import make_tiny, max_rel_err

from freetoken_agent import Engine, SamplingParams
from freetoken_agent.engine.experts import calibration
from freetoken_agent.engine.path_graphs import PathDecodeGraphs
from freetoken_agent.kernels.cpu import worker

pytestmark = pytest.mark.gpu

CUDA = dict(device="cuda", progress=False, max_model_len=512, max_num_seqs=4)
SPLIT = dict(policy="adaptive", split_expert=True)


def _resident_run(tmp_path, rng_seed: int, max_tokens: int):
    # Experts of width 64: cuts at 16, 32 or 48 (width 32, the tiny default, always cuts at 16),
    # so the cut trials change the cut on the device, each change after a drain.
    make_tiny("qwen3_moe", tmp_path, rng_seed, num_experts=16, num_experts_per_tok=4,
              moe_intermediate_size=64)  # fmt: skip
    rng = random.Random(rng_seed)
    prompts = [[rng.randrange(3, 320) for _ in range(n)] for n in (9, 40)]
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    resident = Engine.load(tmp_path, policy="resident", **CUDA)
    return prompts, sp, [o.token_ids for o in resident.generate(prompts, sp)], resident


@pytest.mark.parametrize("overlap", [False, True])
def test_split_path_on_cuda_matches_resident(tmp_path, rng_seed, overlap, monkeypatch):
    if not worker.available():
        pytest.fail("the device image has no C++ compiler: the CPU expert kernel did not build")
    # The rates stay where each engine's draw sets them (the online estimates would replace
    # them with this machine's within a step, and every engine then cut alike: the H100 run
    # of the forty-eighth session saw only 48), so the three engines cut at different places.
    monkeypatch.setattr(calibration, "update", lambda estimate, nbytes, seconds: estimate)
    rng = random.Random(rng_seed)
    links = [rng.uniform(0.2, 0.3), rng.uniform(0.45, 0.55), rng.uniform(0.7, 0.8)]
    rng.shuffle(links)  # cuts near 16, 32 and 48 of 64 columns
    prompts, sp, want, resident = _resident_run(tmp_path, rng_seed, max_tokens=24)
    ids = prompts[1] + want[1]
    want_logits = resident.score(ids)
    rows = resident.spec.n_moe_layers * resident.spec.n_experts
    opts = {**CUDA, "overlap_schedule": overlap}
    cuts = set()  # the cuts the engines ran
    for slots, link in zip((1, rng.randint(5, rows // 2), rows - 1), links, strict=True):
        engine = Engine.load(tmp_path, expert_slots=slots, **SPLIT, **opts)
        fills = engine.loaded.bank.cache.on_device
        set_cut = fills.set_cut
        fills.set_cut = lambda value, set_cut=set_cut: (cuts.add(value), set_cut(value))
        bank, graphs = engine.loaded.bank, engine.runner.graphs
        assert isinstance(graphs, PathDecodeGraphs) and graphs.split is not None
        assert graphs.split.split and not graphs.shared.split and not graphs.device.split
        bank.adaptive.path_params = {"fixed": "split"}
        bank.bandwidths.pcie, bank.bandwidths.cpu = link, 1.0 - link
        bank.cpu_share.observe = lambda bandwidths: None  # keep the rates' cut set here
        assert [o.token_ids for o in engine.generate(prompts, sp)] == want, slots
        assert graphs.device_steps > 0
        st = engine.stats()["experts"]
        if slots < rows // 2:
            assert st["split"] > 0
        assert st["cpu_share"]["broken"] is None
        ctrl = bank.cpu_share.box.ctrl
        bank.cache.on_device.release()  # drains the copies behind
        assert int(ctrl[worker.BEHIND_EXPERTS]) == st["split"]
        assert int(ctrl[worker.ERROR]) == 0
        assert max_rel_err(engine.score(ids), want_logits) <= 1e-4
        print(f"slots {slots}: split {st['split']} split_hits {st['split_hits']} "
              f"fetched {st['fetched']}")  # fmt: skip
        engine.check_integrity()
        engine.close()
    print(f"cuts {sorted(cuts)}")
    assert len(cuts) >= 2, cuts


@pytest.mark.parametrize("overlap", [False, True])
def test_adaptive_alternating_with_the_split_path_on_cuda_matches_resident(tmp_path, rng_seed,
                                                                           overlap):  # fmt: skip
    """Every path two steps at a time (stops, device, shared, split): each switch away from
    split drains its copies behind, and the cache stays whole for the others."""
    rng = random.Random(rng_seed)
    prompts, sp, want, _ = _resident_run(tmp_path, rng_seed, max_tokens=32)
    opts = {**CUDA, "overlap_schedule": overlap}
    engine = Engine.load(tmp_path, expert_slots=rng.randint(5, 20), **SPLIT, **opts)
    bank, graphs = engine.loaded.bank, engine.runner.graphs
    assert bank.adaptive.split_ok
    bank.adaptive.path_params = dict(block=2, rotations=1, period=0, warm=0)
    bank.adaptive.verdict = lambda gain: "all"
    bank.adaptive.shared_gate = False
    assert [o.token_ids for o in engine.generate(prompts, sp)] == want
    st = engine.stats()["experts"]
    assert graphs.device_steps > 0 and st["split"] > 0
    engine.check_integrity()
    engine.close()
