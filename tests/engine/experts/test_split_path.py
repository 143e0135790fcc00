"""adaptive's `split` path (engine/experts/split_expert.py): every fill cut between the link and
the CPU worker, which copies its columns into the slot behind the step, gives the resident
engine's tokens and logits at any budget and cut; switching paths drains the copies behind
and keeps the cache whole; a worker that stops answering turns the path off."""

import random

import pytest
import torch
from tiny_models import make_tiny

from freetoken_agent import Engine, SamplingParams
from freetoken_agent.kernels import reference_fills as ref
from freetoken_agent.kernels.cpu import worker

pytestmark = pytest.mark.skipif(not worker.available(), reason="no SIMD expert kernel here")

OPTS = dict(device="cpu", progress=False, dtype="float32")


def _split_engine(path, slots: int, link_fraction: float, **opts) -> Engine:
    engine = Engine.load(path, policy="adaptive", expert_slots=slots, split_expert=True, **OPTS,
                         **opts)  # fmt: skip
    bank = engine.loaded.bank
    assert bank.device_path.split is not None and bank.adaptive.split_ok
    bank.adaptive.path_params = {"fixed": "split"}
    # The cut is I * s B_P / (s B_P + B_H) of the estimates (split_expert.py FRONT_SHARE).
    bank.bandwidths.pcie, bank.bandwidths.cpu = link_fraction, 1.0 - link_fraction
    bank.cpu_share.observe = lambda bandwidths: None  # keep the cut this test set
    return engine


def _prompts(rng: random.Random, n: int = 3) -> list[list[int]]:
    return [[rng.randrange(3, 320) for _ in range(rng.randint(3, 30))] for _ in range(n)]


@pytest.mark.parametrize("overlap", [False, True])
def test_split_path_gives_the_resident_tokens_and_logits(tmp_path, rng_seed, overlap):
    # Experts of width 64: the cuts land on 16, 32 or 48 (CUT_ALIGN), from each engine's random
    # link fraction and its cut trials (width 32, the tiny default, always cuts at 16).
    make_tiny("qwen3_moe", tmp_path, rng_seed, num_experts=16, num_experts_per_tok=4,
              moe_intermediate_size=64)  # fmt: skip
    rng = random.Random(rng_seed)
    prompts = _prompts(rng)
    sp = SamplingParams(max_tokens=rng.randint(8, 16), temperature=0, ignore_eos=True)
    resident = Engine.load(tmp_path, policy="resident", overlap_schedule=overlap, **OPTS)
    want = [o.token_ids for o in resident.generate(prompts, sp)]
    scored = prompts[0][:20]
    want_logits = resident.score(scored)
    n_lids = resident.loaded.spec.n_moe_layers * 16
    cuts = set()  # the cuts the engines ran
    # One engine's rates cut at 16, another's at 32 or 48 (split_expert.py's link fraction:
    # half of B_P against B_H), the third's anywhere.
    fractions = [rng.uniform(0.1, 0.3), rng.uniform(0.75, 0.9), rng.uniform(0.1, 0.9)]
    rng.shuffle(fractions)
    for slots, fraction in zip((1, rng.randint(2, n_lids // 2), n_lids - 1), fractions,
                               strict=True):  # fmt: skip
        engine = _split_engine(tmp_path, slots, fraction, overlap_schedule=overlap)
        fills = engine.loaded.bank.cache.on_device
        set_cut = fills.set_cut
        fills.set_cut = lambda value, set_cut=set_cut: (cuts.add(value), set_cut(value))
        got = [o.token_ids for o in engine.generate(prompts, sp)]
        assert got == want, slots
        torch.testing.assert_close(engine.score(scored), want_logits, rtol=1e-4, atol=1e-4)
        st = engine.stats()["experts"]
        assert st["split"] <= st["fetched"], (slots, st)
        if slots < n_lids // 2:  # many misses: fills were cut
            assert st["split"] > 0, (slots, st)
        share = st["cpu_share"]
        assert share["broken"] is None and share["jobs"] >= st["split"] // 64
        ctrl = engine.loaded.bank.cpu_share.box.ctrl
        assert int(ctrl[worker.BEHIND_EXPERTS]) == st["split"]  # each cut fill copied behind
        engine.check_integrity()
        engine.close()
    assert 16 in cuts and cuts & {32, 48}, cuts


def test_switching_paths_drains_the_copies_behind(tmp_path, rng_seed):
    """split, then device and stops steps: each later path finds every slot whole (the device
    path's MoE kernels read whole slots, the host's mirror is rebuilt from the tables)."""
    make_tiny("qwen3_moe", tmp_path, rng_seed, num_experts=16, num_experts_per_tok=4)
    rng = random.Random(rng_seed)
    prompts = _prompts(rng, 2)
    sp = SamplingParams(max_tokens=rng.randint(12, 20), temperature=0, ignore_eos=True)
    want = [o.token_ids for o in Engine.load(tmp_path, policy="resident", **OPTS).generate(
        prompts, sp)]  # fmt: skip
    engine = _split_engine(tmp_path, rng.randint(4, 20), rng.uniform(0.2, 0.8))
    bank = engine.loaded.bank
    adaptive = bank.adaptive
    order, step = ["split", "device", "split", "stops", "split", "shared"], [0]
    measured, timed = adaptive.path_measured, adaptive.step_timed
    # One path a decode step, the next after it: a step reads its path several times.
    adaptive.path = lambda n: order[step[0] % len(order)] if measured(n) else "stops"

    def step_timed(n_tokens: int, seconds: float) -> None:
        step[0] += 1
        timed(n_tokens, seconds)

    adaptive.step_timed = step_timed
    got = [o.token_ids for o in engine.generate(prompts, sp)]
    assert got == want
    st = engine.stats()["experts"]
    assert step[0] >= len(order) and st["split"] > 0 and bank.cache.on_device.releases >= 1
    tables = bank.cache.on_device.split
    bank.cache.on_device.release()  # drains: every slot whole, none in flight
    assert not bank.device_path.split.dirty
    assert bool((tables.cols == tables.width).all())
    engine.check_integrity()
    engine.close()


def test_a_worker_that_stops_answering_turns_the_split_path_off(tmp_path, rng_seed):
    make_tiny("qwen3_moe", tmp_path, rng_seed, num_experts=16, num_experts_per_tok=4)
    rng = random.Random(rng_seed)
    prompt = [rng.randrange(3, 320) for _ in range(12)]
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want = Engine.load(tmp_path, policy="resident", **OPTS).generate(prompt, sp).token_ids
    engine = _split_engine(tmp_path, 3, 0.5, overlap_schedule=False)
    share = engine.loaded.bank.cpu_share
    assert engine.generate(prompt, sp).token_ids == want  # the worker answers
    share.worker.stop()  # ... and now does not
    share.timeout_s = 0.05
    out = engine.generate(prompt, sp)
    assert out.finish_reason == "error" and "CPU expert worker did not answer" in out.error
    bank = engine.loaded.bank
    assert not bank.adaptive.split_ok and bank.adaptive.path(1) == "device"
    assert "split" not in bank.adaptive.paths(1).candidates
    assert engine.generate(prompt, sp).token_ids == want  # the engine serves on, whole
    engine.check_integrity()
    engine.close()


def test_the_split_path_is_off_unless_asked_for(tmp_path, rng_seed):
    """EngineConfig.split_expert off (the default): no split tables, no copies behind, and the
    path trials never run it."""
    make_tiny("qwen3_moe", tmp_path, rng_seed, num_experts=16, num_experts_per_tok=4)
    engine = Engine.load(tmp_path, policy="adaptive", expert_slots=6, **OPTS)
    bank = engine.loaded.bank
    assert bank.cpu_share is not None and bank.device_path.split is None
    assert not bank.adaptive.split_ok and "split" not in bank.adaptive.paths(1).candidates
    assert bank.cpu_share.worker.behind is None
    bank.reset_decisions()  # (the benchmark's, between measurements)
    assert not bank.adaptive.split_ok
    engine.close()


def test_forgetting_decisions_keeps_the_split_path(tmp_path, rng_seed):
    """The benchmark's reset between measurements makes adaptive anew: the split path stays
    offered while its worker runs, and not once the worker failed."""
    make_tiny("qwen3_moe", tmp_path, rng_seed, num_experts=16, num_experts_per_tok=4)
    engine = _split_engine(tmp_path, 6, 0.5)
    bank = engine.loaded.bank
    bank.reset_decisions()
    assert bank.adaptive.split_ok and "split" in bank.adaptive.paths(1).candidates
    bank.cpu_share.broken = "a test's"
    bank.reset_decisions()
    assert not bank.adaptive.split_ok
    engine.close()


def _after_split_steps(tmp_path, rng_seed: int, min_slots: int, max_slots: int):
    """An engine held on split after one generation that gave the resident tokens, and `run`:
    the same generation again, asserting the resident tokens."""
    make_tiny("qwen3_moe", tmp_path, rng_seed, num_experts=16, num_experts_per_tok=4)
    rng = random.Random(rng_seed)
    prompts = _prompts(rng, 2)
    sp = SamplingParams(max_tokens=rng.randint(6, 12), temperature=0, ignore_eos=True)
    want = [o.token_ids for o in Engine.load(tmp_path, policy="resident", **OPTS).generate(
        prompts, sp)]  # fmt: skip
    engine = _split_engine(tmp_path, rng.randint(min_slots, max_slots), rng.uniform(0.2, 0.8))

    def run() -> None:
        assert [o.token_ids for o in engine.generate(prompts, sp)] == want

    run()
    return engine, run


def test_gpu_fill_after_split_steps_drains_them_first(tmp_path, rng_seed):
    """A policy switch to gpu-fill (the benchmark's) after split steps: its plans and MoE
    kernels read whole slots, so the copies behind land first."""
    engine, run = _after_split_steps(tmp_path, rng_seed, 3, 12)
    bank = engine.loaded.bank
    assert bank.device_path.split.dirty  # split steps ran, nothing drained them since
    bank.policy = "gpu-fill"
    run()
    assert not bank.device_path.split.dirty
    engine.check_integrity()
    engine.close()


def test_a_copy_behind_that_failed_loses_its_slot_and_turns_the_path_off(tmp_path, rng_seed):
    """A cut slot whose copies behind never came (the copier's BEHIND_ERROR: refused, dropped,
    a driver error): the drain evicts it rather than call it whole, its stale columns past the
    cut never serve, and the split path is off from then on while the CPU share goes on."""
    engine, run = _after_split_steps(tmp_path, rng_seed, 6, 20)
    bank = engine.loaded.bank
    fills, split = bank.cache.on_device, bank.device_path.split
    assert fills.owned and split.dirty
    resident = (fills.lid_of >= 0).nonzero().flatten()  # [R] slots
    cut = int(fills.state[ref.SPLIT_COLS])
    # As if every resident's copies behind failed: cut, never landed, and the columns past the
    # cut still the last expert's (NaN here: one read of them poisons the tokens).
    split.tables.cols[resident], split.tables.landed[resident] = cut, -1
    bank.cache.w13[resident, cut : split.width] = float("nan")
    bank.cpu_share.box.ctrl[worker.BEHIND_ERROR] = -7
    run()
    assert split.failed is not None and not bank.adaptive.split_ok
    assert "split" not in bank.adaptive.paths(1).candidates  # the trials made anew without it
    assert bank.cpu_share.broken is None  # the share goes on
    engine.check_integrity()
    engine.close()
