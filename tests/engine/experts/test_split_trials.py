"""`adaptive` picks its in-band split by measured step time (split_trials.py), and which mode
runs never changes results."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import make_tiny

from freetoken_agent import Engine, SamplingParams
from freetoken_agent.engine.experts.policy import (
    FETCH_ALL_GAIN,
    FETCH_ALL_HOLD_GAIN,
    FETCH_NONE_GAIN,
    Bandwidths,
    FillVerdict,
    fetch_count,
)
from freetoken_agent.engine.experts.split_trials import MODES, SplitTrials
from freetoken_agent.kernels.reference import fused_moe


def _run(trials: SplitTrials, cost: dict[str, float], rng: random.Random, steps: int) -> list:
    """Feed `steps` steps whose seconds per token are `cost[mode]` with 10% noise; returns the
    modes run."""
    ran = []
    for _ in range(steps):
        ran.append(trials.mode)
        trials.step_done(cost[trials.mode] * rng.uniform(0.95, 1.05))
    return ran


def test_trials_keep_the_fastest_mode_and_measure_again(rng_seed):
    rng = random.Random(rng_seed)
    trials = SplitTrials(block=3, rotations=2, period=40)
    explore = 3 * 3 * 2
    for _ in range(4):  # the best mode changes between measurements; each one finds it
        best = rng.choice(MODES)
        cost = {m: rng.uniform(1.3, 2.0) * 1e-2 for m in MODES}
        cost[best] = 1e-2
        ran = _run(trials, cost, rng, explore)
        assert not trials.exploring and trials.chosen == best, (cost, trials.medians())
        # Interleaved: each mode ran in `rotations` separate blocks of `block` steps.
        blocks = [ran[i] for i in range(0, explore, 3)]
        assert all(ran[i : i + 3] == [blocks[i // 3]] * 3 for i in range(0, explore, 3))
        assert sorted(blocks) == sorted(MODES * 2) and blocks[:3] != blocks[3:]
        assert _run(trials, cost, rng, 40) == [best] * 40  # the period runs the chosen mode
        assert trials.exploring  # then it measures again
    assert trials.choices == 4


def test_trials_refuse_a_schedule_that_measures_nothing():
    with pytest.raises(ValueError, match="block >= 1"):
        SplitTrials(block=0)


def test_fill_verdict_holds_fetch_all_until_the_gain_falls_below_the_hold(rng_seed):
    rng = random.Random(rng_seed)
    verdict = FillVerdict()

    def gain(lo: float, hi: float) -> float:
        return rng.uniform(lo, hi)

    for _ in range(5):
        assert verdict(gain(FETCH_NONE_GAIN, FETCH_ALL_HOLD_GAIN)) == "band"
        assert verdict(gain(FETCH_ALL_HOLD_GAIN, FETCH_ALL_GAIN)) == "band"  # never paid yet
        assert verdict(gain(FETCH_ALL_GAIN, 1.0)) == "all"
        for _ in range(rng.randrange(1, 4)):  # a dip into the band keeps fetching all
            assert verdict(gain(FETCH_ALL_HOLD_GAIN, FETCH_ALL_GAIN)) == "all"
        assert verdict(gain(FETCH_NONE_GAIN, FETCH_ALL_HOLD_GAIN)) == "band"
        assert verdict(gain(FETCH_ALL_HOLD_GAIN, FETCH_ALL_GAIN)) == "band"
        assert verdict(gain(-1.0, FETCH_NONE_GAIN)) == "none" == verdict.last


def _bank(tmp_path, rng_seed, **trials):
    make_tiny("qwen3_moe", tmp_path, rng_seed, num_experts=16, num_experts_per_tok=6)
    engine = Engine.load(tmp_path, device="cpu", policy="adaptive", expert_slots=9, progress=False)
    engine.loaded.bank.adaptive.trials = SplitTrials(**trials)
    return engine


def test_in_band_the_trials_mode_places_the_misses(tmp_path, rng_seed):
    """Fill race in band: `all` fetches every miss, `split` q*, `none` only into free slots;
    outside the band the race decides whatever the trials say. Results stay exact."""
    engine = _bank(tmp_path, rng_seed)
    bank, spec = engine.loaded.bank, engine.spec
    e, k = spec.n_experts, spec.top_k
    gen = torch.Generator().manual_seed(rng_seed)
    bank.bandwidths = Bandwidths(pcie=30e9, cpu=10e9)
    differed = 0
    cases = [(0.0, m, m) for m in MODES] * 4 + [(0.9, "none", "all"), (-0.5, "all", "none")] * 2
    for gain, mode, expect in cases:
        bank.cache.fill_gain = gain
        bank.adaptive.trials.chosen, bank.adaptive.trials._exploring = mode, False
        layer = int(torch.randint(spec.n_moe_layers, (1,), generator=gen))
        ids = torch.randperm(e, generator=gen)[:k].int()[None]  # [1, K]
        hidden = torch.randn(1, spec.hidden_size, generator=gen)
        weights = torch.rand(1, k, generator=gen)
        before = (bank.stats.fetched, bank.stats.hits)
        free = bank.cache.free_slots
        out = bank(layer, hidden, ids, weights)
        want = fused_moe(hidden, bank.pool.w13, bank.pool.w2, ids + layer * e, weights)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        misses = k - (bank.stats.hits - before[1])
        fetched = bank.stats.fetched - before[0]
        q = {"all": misses, "split": fetch_count("adaptive", misses, bank.bandwidths), "none": 0}
        assert fetched == max(q[expect], min(free, misses)), (gain, mode, fetched, misses, free)
        differed += free == 0 and misses > q["split"] > 0
    assert differed > 0
    bank.check_integrity()


def test_decode_steps_feed_the_trials_and_switching_modes_keeps_the_tokens(tmp_path, rng_seed):
    """The runner times every decode step for the bank; a mode switch every step (block 1,
    period 0) gives the resident engine's greedy tokens; prefill steps and steps out of band
    are not samples."""
    engine = _bank(tmp_path, rng_seed, block=1, rotations=1, period=0)
    resident = Engine.load(tmp_path, device="cpu", policy="resident", progress=False)
    bank, rng = engine.loaded.bank, random.Random(rng_seed)
    prompt = [rng.randrange(engine.spec.vocab_size) for _ in range(40)]
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    seen = []
    trials = bank.adaptive.trials
    step_done = trials.step_done
    trials.step_done = lambda s: (seen.append((trials.mode, s)), step_done(s))

    def generate(gain: float) -> list[int]:
        rid = engine.submit(prompt, sp)
        while engine.has_unfinished():
            bank.cache.fill_gain = gain  # a step's fills move the race: pin it
            engine.step()
        return engine._collect(rid).token_ids

    assert generate(0.0) == resident.generate(prompt, sp).token_ids  # in band
    assert len(seen) == sp.max_tokens - 1  # the first token comes from the prefill step
    assert all(s > 0 for _, s in seen)
    assert {m for m, _ in seen} == set(MODES)  # every mode placed misses of this request
    seen.clear()
    generate(0.9)  # out of band: the race fetches all, the trials wait
    assert seen == []


def test_prefill_chunks_fill_without_racing(tmp_path, rng_seed):
    """A chunk longer than RACE_MAX_TOKENS (too short to stream) fills without starting fill
    races, so its fills cannot drag the decode gain to 0; a decode-sized call races its fills.
    Both stay exact."""
    from freetoken_agent.engine.experts.fill_races import RACE_MAX_TOKENS

    engine = _bank(tmp_path, rng_seed)
    bank, spec = engine.loaded.bank, engine.spec
    gen = torch.Generator().manual_seed(rng_seed)
    bank.cache.fill_gain = 0.9  # fetch every miss
    for tokens, races in ((RACE_MAX_TOKENS + 1 + int(torch.randint(40, (1,), generator=gen)),
                           False), (int(torch.randint(1, RACE_MAX_TOKENS + 1, (1,),
                                                      generator=gen)), True)):  # fmt: skip
        bank.cache.reset()
        bank.cache.fill_gain = 0.9
        for _ in range(3):  # past the free slots: fills evict victims
            layer = int(torch.randint(spec.n_moe_layers, (1,), generator=gen))
            ids = torch.randint(spec.n_experts, (tokens, spec.top_k), generator=gen).int()
            hidden = torch.randn(tokens, spec.hidden_size, generator=gen)
            weights = torch.rand(tokens, spec.top_k, generator=gen)
            out = bank(layer, hidden, ids, weights)
            want = fused_moe(hidden, bank.pool.w13, bank.pool.w2, ids + layer * spec.n_experts,
                             weights)  # fmt: skip
            torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        assert bank.stats.fetched > 0 and bank.cache.fills > 0
        assert bool(bank.cache.races.pending) == races, tokens
