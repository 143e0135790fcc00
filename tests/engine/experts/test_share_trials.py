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
from freetoken_agent.engine.experts.cache import ExpertCache
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


def _plan_spy(monkeypatch, engine_of) -> list[tuple[int, int, int, bool]]:
    """Every device plan's (misses, fills, CPU experts, CPU_ALL_MISSES as set), appended to
    the returned list; `engine_of()` names the engine running."""
    plans: list[tuple[int, int, int, bool]] = []
    counters = (ref.FILLS, ref.HOST_READS, ref.CPU_EXPERTS)

    def spy(*args, **kw):
        state = args[5]
        before = [int(state[i]) for i in counters]
        flag = engine_of().loaded.bank.cache.on_device.all_misses
        assert bool(state[ref.CPU_ALL_MISSES]) == flag  # the plan reads what the host set
        rows = plan_fills(*args, **kw)
        fills, reads, cpu = (int(state[i]) - b for i, b in zip(counters, before, strict=True))
        plans.append((fills + reads + cpu, fills, cpu, flag))
        return rows

    monkeypatch.setattr(device_path, "plan_fills", spy)
    return plans


def _check_plans(plans: list[tuple[int, int, int, bool]]) -> None:
    """Each plan's rule (`_plan_spy`'s records): the CPU takes every miss exactly where the
    bound was lifted; elsewhere the layer fills at least one and the CPU takes the rest."""
    for misses, fills, cpu, lifted in plans:
        assert (fills == 0 and cpu == misses) if lifted else (fills >= 1 and cpu == misses - fills)


@pytest.mark.skipif(not worker.available(), reason="no SIMD expert kernel here")
@pytest.mark.parametrize(
    "case", ["fills pay", "fills do not pay", "race not judged", "switch off", "free slots"]
)
def test_the_cpu_takes_every_miss_only_where_fills_do_not_pay(tmp_path, rng_seed, monkeypatch,
                                                              case):  # fmt: skip
    """The shared path at a held share of 1: a layer that misses keeps a fill while fills pay,
    before the race has judged (its gain reads 0 then), under bench offload's switch off
    (--every-miss-ab's kept rows) and while a slot is free (a fill into it evicts nothing).
    Otherwise the CPU takes every miss and the plan fills none. The tokens are the resident
    engine's every way."""
    rng, prompts, sp, opts, want = _tiny_and_resident(tmp_path, rng_seed, 16)
    engines = []
    plans = _plan_spy(monkeypatch, lambda: engines[-1])
    if case == "free slots":  # the host's last look at the cache found a slot free
        monkeypatch.setattr(ExpertCache, "free_slots_seen", property(lambda self: 1))
    engine = Engine.load(tmp_path, policy="adaptive", expert_slots=rng.randint(4, 12), **opts)
    engines.append(engine)
    adaptive = engine.loaded.bank.adaptive
    adaptive.path_params = {"fixed": "shared"}
    adaptive.shared_gate = False
    adaptive.held_share = 1.0
    adaptive.fills_pay = lambda: case == "fills pay"
    adaptive.fills_judged = lambda: case != "race not judged"
    got = []
    with every_miss(engine, False if case == "switch off" else None):
        for prompt in prompts:
            got.append(engine.generate(prompt, sp).token_ids)
            # The device path's fills reach the host's mirror when it takes the cache back
            # (a stops step does, once a path measurement): the first reply filled every slot.
            assert engine.loaded.bank.cache.free_slots == 0
    assert adaptive.cpu_all_misses  # as loaded after the switch
    engine.close()
    assert got == want
    missed = [p for p in plans if p[0] > 0]
    assert len(missed) >= 4, plans  # layers that missed on the device path
    lifted = [p for p in missed if p[3]]
    if case == "fills do not pay":
        assert lifted, plans  # once the cache was full
    else:
        assert not lifted, plans
    _check_plans(missed)


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
    from freetoken_agent.engine.experts.adaptive import AdaptiveFetches

    rng, _, _, opts, _ = _tiny_and_resident(tmp_path, rng_seed, 4)
    engines = []
    plans = _plan_spy(monkeypatch, lambda: engines[-1])
    monkeypatch.setattr(offload_decode, "WARM_UP", 2)
    # A held path runs no stops step, so its race never judges: say it did (on the class,
    # as the measurement makes a new policy object), with fills not paying.
    monkeypatch.setattr(AdaptiveFetches, "fills_judged", lambda self: True)
    monkeypatch.setattr(AdaptiveFetches, "fills_pay", lambda self: False)
    monkeypatch.setattr(ExpertCache, "free_slots_seen", property(lambda self: 0))
    engine = Engine.load(tmp_path, policy="adaptive", expert_slots=rng.randint(4, 12), **opts)
    engines.append(engine)
    bank = engine.loaded.bank
    for on in (False, True):
        plans.clear()
        with every_miss(engine, on):
            offload_decode.measure_policy(engine, bank, "adaptive", 1, 8, rng, 1e9, 1e9,
                                          path="shared", shared_gate=False, context=8,
                                          held_share=1.0)  # fmt: skip
            assert bank.adaptive.cpu_all_misses is on
        assert bank.adaptive.cpu_all_misses  # as loaded
        missed = [p for p in plans if p[0] > 0]
        assert len(missed) >= 4, plans
        assert any(flag for *_, flag in missed) is on, plans  # lifted once the cache was full
        _check_plans(missed)
    engine.close()
