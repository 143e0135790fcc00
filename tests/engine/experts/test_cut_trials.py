"""The split path's cut, tuned around the rates' by measured step time (cut_trials.py on
offset_trials.py): the climb reaches a far cut in a few quick measurements and then holds for
its period; a new cut first drains the copies behind; cuts moved by the trials keep the
resident engine's tokens."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from offset_climb import climb
from tiny_models import make_tiny

from freetoken_agent import Engine, SamplingParams
from freetoken_agent.engine.experts.adaptive import AdaptiveFetches
from freetoken_agent.engine.experts.cut_trials import STEP, CutTrials
from freetoken_agent.engine.experts.policy import Bandwidths
from freetoken_agent.kernels.cpu import worker


def test_the_cut_climbs_far_in_quick_measurements_then_holds(rng_seed):
    rng = random.Random(rng_seed)
    far = rng.choice([-4, -3, 3, 4])  # STEPs from the rates' cut
    best = STEP * far + rng.uniform(-0.02, 0.02)
    period, moving = rng.randrange(40, 80), rng.randrange(0, 5)
    trials = CutTrials(block=2, rotations=1, period=period, moving_period=moving)
    ends = climb(trials, best, rng, abs(far) + 4)
    measured = 3 * 2  # steps of one measurement: three offsets, one block of 2 each
    biases = [bias for _, bias in ends]
    arrived = next(k for k, bias in enumerate(biases) if abs(bias - best) <= STEP / 2 + 1e-9)
    assert arrived == abs(far) - 1, (best, biases)  # one STEP a measurement, none wasted
    assert biases[arrived:] == [biases[arrived]] * (len(biases) - arrived)  # holds there
    gaps = [b - a for (a, _), (b, _) in zip(ends, ends[1:], strict=False)]
    # While it moves the next measurement starts after `moving` steps (at least the one that
    # ends the wait), once there after the period (or a backed-off multiple of it).
    assert gaps[:arrived] == [max(moving, 1) + measured] * arrived, (gaps, arrived)
    assert all(gap >= period + measured for gap in gaps[arrived + 1 :]), gaps


def test_a_climb_held_at_its_bounds_waits_the_period(rng_seed):
    """Past the offsets where the cut still moves (SplitExpert.offset_span) the candidates
    tie: a measurement that finds the bias at its bound holds, and waits the period."""
    rng = random.Random(rng_seed)
    period = rng.randrange(40, 80)
    trials = CutTrials(block=2, rotations=1, period=period, moving_period=0)
    low = -STEP * rng.randint(1, 2)
    trials.bounds = (low, STEP * rng.randint(1, 3))
    ends = climb(trials, -0.9, rng, 8)  # the fastest cut lies far below the bound
    biases = [bias for _, bias in ends]
    assert biases[-1] == pytest.approx(low) and min(biases) >= low - 1e-9, biases
    held = next(k for k, bias in enumerate(biases) if bias == pytest.approx(low))
    gaps = [b - a for (a, _), (b, _) in zip(ends, ends[1:], strict=False)]
    assert all(gap >= period + 6 for gap in gaps[held + 1 :]), (gaps, held)  # after the move


def test_cut_trials_refuse_bad_schedules():
    with pytest.raises(ValueError, match="cut trials need block >= 2"):
        CutTrials(block=1)
    with pytest.raises(ValueError, match="moving_period >= 0"):
        CutTrials(moving_period=-1)


@pytest.mark.skipif(not worker.available(), reason="no SIMD expert kernel here")
@pytest.mark.parametrize("overlap", [False, True])
def test_cuts_moved_by_the_trials_keep_the_resident_tokens(tmp_path, rng_seed, overlap):
    """The split path held, its cut trials measuring every few steps on experts of width 128
    (cuts 16 columns apart a STEP): the plans ran several cuts, each change after a drain of
    the copies behind, and the tokens are the resident engine's."""
    make_tiny("qwen3_moe", tmp_path, rng_seed, num_experts=16, num_experts_per_tok=4,
              moe_intermediate_size=128)  # fmt: skip
    rng = random.Random(rng_seed)
    prompts = [[rng.randrange(3, 320) for _ in range(rng.randint(3, 30))] for _ in range(2)]
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    opts = dict(device="cpu", progress=False, dtype="float32", overlap_schedule=overlap)
    want = [o.token_ids for o in Engine.load(tmp_path, policy="resident", **opts).generate(
        prompts, sp)]  # fmt: skip
    engine = Engine.load(tmp_path, policy="adaptive", expert_slots=rng.randint(2, 20),
                         split_expert=True, **opts)  # fmt: skip
    bank = engine.loaded.bank
    bank.adaptive.path_params = {"fixed": "split"}
    bank.adaptive.cut_params = dict(block=2, rotations=1, period=0, moving_period=0)
    bank.bandwidths.cpu, bank.bandwidths.pcie = 0.5, 0.5
    bank.cpu_share.observe = lambda bandwidths: None  # keep the rates' cut at 48 (B_H)
    split, fills = bank.device_path.split, bank.cache.on_device
    # The rates' cut: the front columns at half the link's rate (split_expert.py FRONT_SHARE)
    # against the CPU's, I * 0.25 / 0.75 on 16s; I / 2 where half the link matches the CPU.
    assert split.cut(bank.bandwidths) == 48
    assert split.cut(Bandwidths(pcie=2e9 * rng.uniform(2, 9), cpu=1e9)) > 64
    assert split.cut(Bandwidths(pcie=2e9, cpu=1e9)) == 64
    assert split.cut(Bandwidths(pcie=1e9, cpu=1e12)) == 16  # never less than CUT_ALIGN
    # The offsets within which the cut moves: CUT_ALIGN at the low end, I - CUT_ALIGN at the
    # high one, a column step inside each.
    low, high = split.offset_span(bank.bandwidths)
    assert [split.cut(bank.bandwidths, x) for x in (low, low + 1 / 8, high - 1 / 8, high)] == [
        16, 32, 96, 112]  # fmt: skip
    # The cut of each split step, and whether it changed with slots in flight (not drained).
    cuts, undrained = [], []
    set_cut = fills.set_cut
    fills.set_cut = lambda value: (cuts.append(value),
                                   undrained.append(value != fills.cut and split.dirty),
                                   set_cut(value))  # fmt: skip
    got = [o.token_ids for o in (engine.generate(p, sp) for p in prompts)]
    assert got == want
    assert len(set(cuts)) >= 2 and all(16 <= c <= 112 and c % 16 == 0 for c in cuts), cuts
    assert not any(undrained)  # every change of cut drained the copies behind first
    assert engine.stats()["experts"]["split"] > 0
    assert bank.adaptive.cuts(1).bounds == pytest.approx(split.offset_span(bank.bandwidths))
    engine.check_integrity()
    engine.close()


def test_the_path_trials_time_split_at_its_kept_cut(rng_seed):
    """While adaptive's path trials measure, a split step runs the cut trials' kept bias, not
    the candidate they were trying (the split path is timed as it would be kept); once split
    is kept the cut trials' candidates run."""
    rng = random.Random(rng_seed)
    cache = SimpleNamespace(fill_gain=0.0, kept_layers=frozenset())
    adaptive = AdaptiveFetches(cache, n_layers=4, device_tokens=4,
                               path_params=dict(block=2, rotations=1, period=rng.randint(9, 20),
                                                warm=0))  # fmt: skip
    adaptive.split_ok = True
    adaptive.cut_params = dict(block=2, rotations=1, period=0, moving_period=0)
    runs = []  # (path trials measuring, the cut trials' bias, the offset a split step ran)
    cuts, fed = adaptive.cuts(1), []  # whether each step was a sample for the cut trials
    cut_step = cuts.step_done
    cuts.step_done = lambda seconds: (fed.__setitem__(-1, True), cut_step(seconds))
    measured = []  # whether the path trials measured during each step
    for _ in range(rng.randint(80, 120)):
        path, exploring = adaptive.path(1), adaptive.paths(1).exploring
        measured.append(exploring)
        if path == "split":
            runs.append((exploring, cuts.bias, adaptive.cut_offset(1)))
        # split the fastest path, its cuts' times apart (their offsets' distance from -0.25)
        cost = 1.0 + abs(cuts.offset + 0.25) if path == "split" else 3.0
        fed.append(False)
        adaptive.step_timed(1, cost * rng.uniform(0.99, 1.01))
    measuring = [(bias, offset) for exploring, bias, offset in runs if exploring]
    kept = [(bias, offset) for exploring, bias, offset in runs if not exploring]
    assert measuring and kept, runs
    assert all(offset == bias for bias, offset in measuring), measuring
    assert any(offset != bias for bias, offset in kept), kept  # the cut trials' candidates
    # No step the path trials measured, nor the first after them, is a sample for the cuts.
    firsts = [k for k in range(1, len(measured)) if measured[k - 1] and not measured[k]]
    assert firsts and not any(fed[k] for k in firsts), (firsts, fed)
    assert not any(f for f, m in zip(fed, measured, strict=True) if m) and any(fed)
