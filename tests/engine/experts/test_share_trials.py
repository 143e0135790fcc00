"""The shared path's CPU share, tuned around q*'s by measured step time (share_trials.py): a
hill-climb that finds the fastest share within one STEP, holds still there, stays within
MAX_BIAS, and never changes results."""

from __future__ import annotations

import random

import pytest
from offset_climb import climb
from tiny_models import make_tiny

from freetoken_agent import Engine, SamplingParams
from freetoken_agent.bench.every_miss_switch import every_miss, every_miss_rows
from freetoken_agent.engine.experts import device_path
from freetoken_agent.engine.experts.share_trials import (
    BLOCK,
    MAX_BIAS,
    PERIOD,
    ROTATIONS,
    STEP,
    ShareTrials,
)
from freetoken_agent.kernels import reference_fills as ref
from freetoken_agent.kernels.cpu import worker
from freetoken_agent.kernels.expert_fills import plan_fills


def test_the_share_climbs_to_the_fastest_and_holds_there(rng_seed):
    rng = random.Random(rng_seed)
    # Near one of the offsets the climb can reach (a best midway between two would tie them)
    best = STEP * rng.randint(-4, 4) + rng.uniform(-0.02, 0.02)
    trials = ShareTrials(block=2, rotations=2, period=rng.randrange(0, 5))
    biases = [bias for _, bias in climb(trials, best, rng, 20)]
    assert abs(biases[-1] - best) <= STEP / 2 + 1e-9, (best, biases)
    assert biases[-4:] == [biases[-1]] * 4  # it holds still once there
    steps = [abs(b - a) for a, b in zip([0.0, *biases[:-1]], biases, strict=True)]
    assert all(s <= STEP + 1e-9 for s in steps)  # one STEP a measurement at most


def test_the_default_trials_climb_three_steps_within_a_rows_first_tokens(rng_seed):
    """With the defaults, a share three STEPs from q*'s is reached in quick measurements
    (each moving one STEP), well inside a row's 256 tokens, then held for the period."""
    rng = random.Random(rng_seed)
    far = rng.choice([-3, 3])
    best = STEP * far + rng.uniform(-0.02, 0.02)
    ends = climb(ShareTrials(), best, rng, abs(far) + 2)
    biases = [bias for _, bias in ends]
    arrived = next(k for k, bias in enumerate(biases) if abs(bias - best) <= STEP / 2 + 1e-9)
    assert arrived == abs(far) - 1, (best, biases)
    assert ends[arrived][0] <= abs(far) * (3 * BLOCK * ROTATIONS + 16), ends  # < 100 steps
    gaps = [b - a for (a, _), (b, _) in zip(ends, ends[1:], strict=False)]
    assert all(gap >= PERIOD for gap in gaps[arrived + 1 :]), gaps  # then the period


def test_the_share_stays_within_max_bias(rng_seed):
    rng = random.Random(rng_seed)
    far = rng.choice([-1, 1]) * rng.uniform(MAX_BIAS + 0.1, 1.0)
    ends = climb(ShareTrials(block=2, rotations=1, period=0), far, rng, 12)
    biases = [bias for _, bias in ends]
    assert biases[-1] == pytest.approx(MAX_BIAS if far > 0 else -MAX_BIAS)
    assert all(abs(b) <= MAX_BIAS + 1e-9 for b in biases)


def _tiny_and_resident(tmp_path, rng_seed, max_tokens: int):
    """A tiny qwen3_moe (16 experts, top-4), two random prompts, greedy params, the CPU load
    options, and the resident engine's tokens for the prompts."""
    make_tiny("qwen3_moe", tmp_path, rng_seed, num_experts=16, num_experts_per_tok=4)
    rng = random.Random(rng_seed)
    prompts = [[rng.randrange(3, 320) for _ in range(rng.randint(3, 30))] for _ in range(2)]
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    opts = dict(device="cpu", progress=False, dtype="float32", overlap_schedule=False)
    want = [o.token_ids for o in Engine.load(tmp_path, policy="resident", **opts).generate(
        prompts, sp)]  # fmt: skip
    return rng, prompts, sp, opts, want


@pytest.mark.skipif(not worker.available(), reason="no SIMD expert kernel here")
def test_shares_moved_by_the_trials_keep_the_resident_tokens(tmp_path, rng_seed):
    """The shared path with the trials measuring every few steps: the plans ran several
    shares, and the tokens are the resident engine's."""
    rng, prompts, sp, opts, want = _tiny_and_resident(tmp_path, rng_seed, 24)
    engine = Engine.load(tmp_path, policy="adaptive", expert_slots=rng.randint(2, 20), **opts)
    bank = engine.loaded.bank
    bank.adaptive.path_params = {"fixed": "shared"}
    bank.adaptive.shared_gate = False  # the path itself, not when adaptive allows it
    bank.adaptive.share_params = dict(block=2, rotations=1, period=0)
    bank.bandwidths.cpu, bank.bandwidths.pcie = 0.5, 0.5
    bank.cpu_share.observe = lambda bandwidths: None  # keep q*'s share at one half
    fills, shares = bank.cache.on_device, set()
    set_share = fills.set_share
    fills.set_share = lambda value, *rest: (shares.add(value), set_share(value, *rest))
    got = [[o for o in out.token_ids] for out in (engine.generate(p, sp) for p in prompts)]
    assert got == want
    assert len(shares - {0}) >= 2, shares  # q*'s share and at least one offset from it
    engine.close()


@pytest.mark.skipif(not worker.available(), reason="no SIMD expert kernel here")
def test_the_cpu_takes_every_miss_only_where_fills_do_not_pay(tmp_path, rng_seed, monkeypatch):
    """The shared path at a held share of 1: while the fill race says fills pay, each layer
    that misses keeps a fill (the cache keeps learning); where they do not, the CPU takes every
    miss and no plan fills, unless bench offload's switch (--every-miss-ab) holds the bound.
    The tokens are the resident engine's every way."""
    rng, prompts, sp, opts, want = _tiny_and_resident(tmp_path, rng_seed, 16)
    plans: list[tuple[int, int, int]] = []  # (misses, fills, CPU experts) of each device plan

    def spy(*args, **kw):
        state = args[5]
        before = [int(state[i]) for i in (ref.FILLS, ref.HOST_READS, ref.CPU_EXPERTS)]
        rows = plan_fills(*args, **kw)
        fills, reads, cpu = (int(state[i]) - b for i, b in zip(
            (ref.FILLS, ref.HOST_READS, ref.CPU_EXPERTS), before, strict=True))  # fmt: skip
        plans.append((fills + reads + cpu, fills, cpu))
        return rows

    monkeypatch.setattr(device_path, "plan_fills", spy)
    for pay, switch in ((True, None), (False, None), (False, False)):
        engine = Engine.load(tmp_path, policy="adaptive", expert_slots=rng.randint(4, 12), **opts)
        adaptive = engine.loaded.bank.adaptive
        adaptive.path_params = {"fixed": "shared"}
        adaptive.shared_gate = False
        adaptive.held_share = 1.0
        adaptive.fills_pay = lambda pay=pay: pay
        plans.clear()
        with every_miss(engine, switch):
            got = [out.token_ids for out in (engine.generate(p, sp) for p in prompts)]
        assert adaptive.cpu_all_misses  # as loaded after the switch
        engine.close()
        assert got == want
        missed = [p for p in plans if p[0] > 0]
        assert len(missed) >= 4, plans  # layers that missed on the device path
        if pay or switch is False:  # a fill in every layer that missed, the rest to the CPU
            assert all(fills >= 1 and cpu == misses - fills for misses, fills, cpu in missed)
        else:
            assert all(fills == 0 and cpu == misses for misses, fills, cpu in missed)


def test_the_every_miss_rows_pair_each_adaptive_row():
    rows = [("a", "adaptive", None, None, 0.5, True), ("t", "transfer", "on", True, None, None)]
    assert every_miss_rows(rows, False) == [(*r, None) for r in rows]
    assert every_miss_rows(rows, True) == [
        ("a+every", "adaptive", None, None, 0.5, True, True),
        ("a+kept", "adaptive", None, None, 0.5, True, False),
        ("t", "transfer", "on", True, None, None, None),
    ]


@pytest.mark.skipif(not worker.available(), reason="no SIMD expert kernel here")
def test_the_every_miss_switch_holds_through_a_bench_measurement(tmp_path, rng_seed,
                                                                 monkeypatch):  # fmt: skip
    """bench offload --every-miss-ab's kept rows: the measurement replaces adaptive's policy
    object (`reset_decisions`) and the switch still holds the bound there (each layer that
    misses fills one), then the engine is as loaded. (The sixty-second session's first device
    A/B ran both rows lifted: the switch was set on the object the reset dropped.)"""
    from freetoken_agent.bench import offload_decode

    rng, _, _, opts, _ = _tiny_and_resident(tmp_path, rng_seed, 4)
    plans: list[tuple[int, int]] = []  # (misses, fills) of each device plan

    def spy(*args, **kw):
        state = args[5]
        before = [int(state[i]) for i in (ref.FILLS, ref.HOST_READS, ref.CPU_EXPERTS)]
        rows = plan_fills(*args, **kw)
        fills, reads, cpu = (int(state[i]) - b for i, b in zip(
            (ref.FILLS, ref.HOST_READS, ref.CPU_EXPERTS), before, strict=True))  # fmt: skip
        plans.append((fills + reads + cpu, fills))
        return rows

    monkeypatch.setattr(device_path, "plan_fills", spy)
    monkeypatch.setattr(offload_decode, "WARM_UP", 2)
    engine = Engine.load(tmp_path, policy="adaptive", expert_slots=rng.randint(4, 12), **opts)
    bank = engine.loaded.bank
    for on in (False, True):
        plans.clear()
        with every_miss(engine, on):
            offload_decode.measure_policy(engine, bank, "adaptive", 1, 6, rng, 1e9, 1e9,
                                          path="shared", shared_gate=False, context=8,
                                          held_share=1.0)  # fmt: skip
            assert bank.adaptive.cpu_all_misses is on
        assert bank.adaptive.cpu_all_misses  # as loaded
        missed = [p for p in plans if p[0] > 0]
        assert len(missed) >= 4, plans
        assert all((fills == 0) if on else (fills >= 1) for _, fills in missed), (on, missed)
    engine.close()
