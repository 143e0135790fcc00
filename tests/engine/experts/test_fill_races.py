"""The fill race's running mean: corrected for its start at 0, silent before MIN_RACES."""

from __future__ import annotations

import random

import pytest
import torch

from freetoken_agent.engine.experts.cache import ExpertCache
from freetoken_agent.engine.experts.fill_races import MIN_RACES, OUTCOME_EMA, FillRaces
from freetoken_agent.engine.experts.policy import FillVerdict
from freetoken_agent.engine.experts.pool import ExpertPool


def test_gain_is_the_weighted_mean_of_the_settled_outcomes(rng_seed):
    """Races settled one by one (a layer of 16 experts, each fill racing a victim of the
    next layer): `gain` reads 0 before MIN_RACES, then the outcomes' exponentially weighted
    mean, whatever their number."""
    rng = random.Random(rng_seed)
    per = 16
    races = FillRaces(per)
    outcomes = []
    for _ in range(rng.randint(MIN_RACES + 1, 80)):
        filled, victim = rng.randrange(per), per + rng.randrange(per)
        races.start(filled, victim)
        filled_won, victim_won = rng.random() < 0.7, rng.random() < 0.4
        slot_of = [-1] * 2 * per
        slot_of[filled] = 0  # the fill still resident; the victim absent
        races.visit(0, [filled] if filled_won else [], slot_of)
        races.visit(1, [victim] if victim_won else [], slot_of)
        outcomes.append(int(filled_won) - int(victim_won))
        if len(outcomes) < MIN_RACES:
            assert races.gain == 0.0
    n = len(outcomes)
    weights = [OUTCOME_EMA * (1 - OUTCOME_EMA) ** (n - 1 - j) for j in range(n)]
    want = sum(w * x for w, x in zip(weights, outcomes, strict=True)) / sum(weights)
    assert races.settled == n
    assert races.gain == pytest.approx(want, abs=1e-12)
    races.clear()
    assert races.gain == 0.0 and races.settled == 0


def test_sparse_fills_with_locality_reach_the_fetch_all_verdict(rng_seed):
    """Native-like routing: each of 12 layers asks for a working set of 8 of 128 experts that
    drifts by one expert every ~30 visits, in a cache with room for nearly all of it (every
    miss filled, as `transfer` does). Fills are few (~0.4 a step) and nearly every one wins
    its race. The verdict must say `all` once MIN_RACES have settled; the uncorrected mean
    (1 - 0.99^n after n wins) was then ~0.18, barely past FETCH_ALL_GAIN, and below it in
    the steps before."""
    rng = random.Random(rng_seed)
    layers, experts, k, slots = 12, 128, 8, 110
    pool = ExpertPool(torch.zeros(layers * experts, 2, 2), torch.zeros(layers * experts, 2, 1))
    cache = ExpertCache(pool, slots, torch.device("cpu"), lids_per_layer=experts)
    working = [rng.sample(range(experts), k) for _ in range(layers)]
    # A warm cache (as after a prompt): every slot taken, the working sets among them.
    warm = [layer * experts + e for layer in range(layers) for e in working[layer]]
    others = [lid for lid in range(layers * experts) if lid not in set(warm)]
    cache.fill(rng.sample(others, slots - len(warm)) + warm, protect=set())
    cache.races.clear()
    verdict = FillVerdict()
    step = 0
    while cache.races.settled < MIN_RACES + 4:
        assert step < 2000, "too few races settled"
        for layer in range(layers):
            if rng.random() < 1 / 30:
                working[layer][rng.randrange(k)] = rng.choice(
                    [e for e in range(experts) if e not in working[layer]]
                )
            lids = [layer * experts + e for e in working[layer]]
            cache.touch(lids)
            cache.fill([lid for lid in lids if not cache.resident(lid)], protect=set(lids))
        step += 1
    assert cache.fill_gain > 0.5
    assert verdict(cache.fill_gain) == "all"
    cache.check_integrity()
