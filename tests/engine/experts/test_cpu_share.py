"""adaptive's `shared` path (engine/experts/cpu_share.py): the device path with the CPU worker
taking a share of each layer's misses gives the resident engine's tokens and logits at any
budget and share, and a worker that stops answering fails the steps it broke, once, then the
share is off and the engine serves on."""

import random

import pytest
import torch
from tiny_models import make_tiny

from freetoken_agent import Engine, SamplingParams
from freetoken_agent.engine.experts.cpu_share import CpuShareFailed
from freetoken_agent.kernels.cpu import worker
from freetoken_agent.kernels.reference_fills import CPU_SHARE, SHARE_ONE

pytestmark = pytest.mark.skipif(not worker.available(), reason="no SIMD expert kernel here")

OPTS = dict(device="cpu", progress=False, dtype="float32")


def _shared_engine(path, slots: int, cpu_fraction: float, **opts) -> Engine:
    engine = Engine.load(path, policy="adaptive", expert_slots=slots, **OPTS, **opts)
    bank = engine.loaded.bank
    assert bank.cpu_share is not None and bank.adaptive.shared_ok
    bank.adaptive.path_params = {"fixed": "shared"}
    bank.adaptive.shared_gate = False  # the path itself, not when adaptive allows it
    # The share is B_H / (B_P + B_H) of the estimates.
    bank.bandwidths.cpu, bank.bandwidths.pcie = cpu_fraction, 1.0 - cpu_fraction + 1e-9
    bank.cpu_share.observe = lambda bandwidths: None  # keep the share this test set
    # Held: the share trials would move it by up to 0.3 (share_trials.py), to none at 0.2.
    bank.adaptive.held_share = cpu_fraction
    return engine


@pytest.mark.parametrize("overlap", [False, True])
def test_shared_path_gives_the_resident_tokens_and_logits(tmp_path, rng_seed, overlap):
    make_tiny("qwen3_moe", tmp_path, rng_seed, num_experts=16, num_experts_per_tok=4)
    rng = random.Random(rng_seed)
    prompts = [[rng.randrange(3, 320) for _ in range(rng.randint(3, 30))] for _ in range(3)]
    sp = SamplingParams(max_tokens=rng.randint(8, 16), temperature=0, ignore_eos=True)
    resident = Engine.load(tmp_path, policy="resident", overlap_schedule=overlap, **OPTS)
    want = [o.token_ids for o in resident.generate(prompts, sp)]
    scored = prompts[0][:20]
    want_logits = resident.score(scored)
    n_lids = resident.loaded.spec.n_moe_layers * 16
    # one slot; a random budget; all but one (all would load the resident bank)
    for slots, fraction in ((1, 1.0), (rng.randint(2, n_lids - 2), rng.uniform(0.4, 0.8)),
                            (n_lids - 1, 0.5)):  # fmt: skip
        engine = _shared_engine(tmp_path, slots, fraction, overlap_schedule=overlap)
        got = [o.token_ids for o in engine.generate(prompts, sp)]
        assert got == want, (slots, fraction)
        torch.testing.assert_close(engine.score(scored), want_logits, rtol=1e-4, atol=1e-4)
        st = engine.stats()["experts"]
        if slots < n_lids // 2:  # many misses: the worker computed some of them
            assert st["cpu_share"]["jobs"] > 0 and st["on_cpu"] > 0
        assert st["cpu_share"]["broken"] is None
        engine.check_integrity()
        engine.close()


def test_close_stops_the_worker(tmp_path, rng_seed):
    make_tiny("qwen3_moe", tmp_path, rng_seed, num_experts=16, num_experts_per_tok=4)
    engine = _shared_engine(tmp_path, 6, 0.5)
    share = engine.loaded.bank.cpu_share
    assert share.worker.running
    engine.close()
    assert not share.worker.running


def test_a_worker_that_stops_answering_fails_its_steps_once(tmp_path, rng_seed):
    make_tiny("qwen3_moe", tmp_path, rng_seed, num_experts=16, num_experts_per_tok=4)
    rng = random.Random(rng_seed)
    prompt = [rng.randrange(3, 320) for _ in range(12)]
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want = Engine.load(tmp_path, policy="resident", **OPTS).generate(prompt, sp).token_ids
    engine = _shared_engine(tmp_path, 3, 1.0, overlap_schedule=False)
    share = engine.loaded.bank.cpu_share
    assert engine.generate(prompt, sp).token_ids == want  # the worker answers
    share.worker.stop()  # ... and now does not
    share.timeout_s = 0.05
    out = engine.generate(prompt, sp)
    assert out.finish_reason == "error" and "CPU expert worker did not answer" in out.error
    assert "off from now on" in out.error
    again = engine.generate(prompt, sp)  # the share is off: the device fills every miss
    assert again.finish_reason == "length" and again.token_ids == want
    st = engine.stats()["experts"]["cpu_share"]
    assert st["broken"] and st["share"] == 0.0


def test_the_workers_columns_are_the_bytes_b_h_learns_from(tmp_path, rng_seed):
    """observe folds the worker's counters into B_H: COLUMNS / I experts' bytes over BUSY_NS
    since the last call (a job on a column slice read that slice of each expert)."""
    from freetoken_agent.engine.experts import calibration
    from freetoken_agent.engine.experts.policy import Bandwidths

    make_tiny("qwen3_moe", tmp_path, rng_seed, num_experts=16, num_experts_per_tok=4)
    engine = Engine.load(tmp_path, policy="adaptive", expert_slots=6, **OPTS)
    share = engine.loaded.bank.cpu_share
    rng = random.Random(rng_seed)
    width = engine.loaded.bank.pool.w2.shape[2]
    bandwidths, ctrl = Bandwidths(), share.box.ctrl
    for _ in range(3):
        columns, ns = rng.randint(1, 50) * rng.randint(1, width), rng.randint(10**5, 10**8)
        before = bandwidths.cpu
        ctrl[worker.COLUMNS] += columns
        ctrl[worker.BUSY_NS] += ns
        share.observe(bandwidths)
        nbytes = columns * share.expert_bytes / width
        assert bandwidths.cpu == pytest.approx(calibration.update(before, nbytes, ns / 1e9))
        assert bandwidths.cpu_seen[-1] == ("worker", pytest.approx(nbytes), ns / 1e9)
    before = bandwidths.cpu
    share.observe(bandwidths)  # nothing new: unchanged
    assert bandwidths.cpu == before and len(bandwidths.cpu_seen) == 3
    engine.close()


def test_a_failed_job_marks_the_mailbox_dead_for_the_steps_queued(tmp_path, rng_seed):
    """A job the worker failed (ctrl[ERROR]) stops the worker; the steps overlap scheduling
    already queued must give up at their first wait, not spin 2 s each: the mailbox is dead."""
    make_tiny("qwen3_moe", tmp_path, rng_seed, num_experts=16, num_experts_per_tok=4)
    engine = _shared_engine(tmp_path, 3, 1.0)
    share = engine.loaded.bank.cpu_share
    ctrl = share.box.ctrl
    assert int(ctrl[worker.TIMEOUT]) == 0
    ctrl[worker.ERROR] = -random.Random(rng_seed).randint(1, 4)
    with pytest.raises(CpuShareFailed, match="failed a job"):
        share.check()
    assert int(ctrl[worker.TIMEOUT]) != 0 and not share.worker.running
    engine.close()


def test_stats_say_where_the_worker_is_pinned(tmp_path, rng_seed, monkeypatch):
    """FREETOKEN_WORKER_CPUS reaches the engine's worker: its cores and the threads pinned
    (every thread of its team) in Engine.stats, and the shared path's tokens are the
    resident engine's."""
    import os

    make_tiny("qwen3_moe", tmp_path, rng_seed, num_experts=16, num_experts_per_tok=4)
    rng = random.Random(rng_seed)
    core = rng.choice(sorted(os.sched_getaffinity(0)))
    monkeypatch.setenv(worker.ENV_CPUS, str(core))
    prompt = [rng.randrange(3, 320) for _ in range(10)]
    sp = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    want = Engine.load(tmp_path, policy="resident", **OPTS).generate(prompt, sp).token_ids
    engine = _shared_engine(tmp_path, 4, 0.5)
    try:
        assert engine.generate(prompt, sp).token_ids == want
        st = engine.stats()["experts"]["cpu_share"]
        assert st["cores"] == [core] and st["jobs"] > 0
        assert st["pinned"] == engine.loaded.bank.cpu_share.worker.threads
    finally:
        engine.close()


def test_a_held_share_is_what_the_plans_run_and_keeps_the_tokens(tmp_path, rng_seed):
    """adaptive.held_share (benches map the share's curve with it): the plans run that share
    whatever q*'s would be, and the tokens are the resident engine's."""
    make_tiny("qwen3_moe", tmp_path, rng_seed, num_experts=16, num_experts_per_tok=4)
    rng = random.Random(rng_seed)
    prompts = [[rng.randrange(3, 320) for _ in range(rng.randint(3, 30))] for _ in range(2)]
    sp = SamplingParams(max_tokens=rng.randint(6, 12), temperature=0, ignore_eos=True)
    want = [o.token_ids for o in Engine.load(tmp_path, policy="resident", **OPTS).generate(
        prompts, sp)]  # fmt: skip
    q_star = rng.uniform(0.1, 0.3)
    held = rng.uniform(0.6, 0.95)  # far from q*'s: the held one must be the one run
    engine = _shared_engine(tmp_path, rng.randint(2, 8), q_star)
    engine.loaded.bank.adaptive.held_share = held
    try:
        assert [o.token_ids for o in engine.generate(prompts, sp)] == want
        fills = engine.loaded.bank.cache.on_device
        assert fills.share == round(held * SHARE_ONE)
        assert int(fills.state[CPU_SHARE]) == round(held * SHARE_ONE)
        assert engine.stats()["experts"]["on_cpu"] > 0
    finally:
        engine.close()
