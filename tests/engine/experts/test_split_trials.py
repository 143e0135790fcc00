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
from freetoken_agent.engine.experts.split_trials import (
    BACKOFF_CAP,
    CLEAR_MARGIN,
    DROP_FACTOR,
    MODES,
    SplitTrials,
)
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
    n = len(MODES)
    explore = n * 3 * 2
    best = None
    for _ in range(4):  # the best mode changes between measurements; each one finds it
        best = rng.choice([m for m in MODES if m != best])  # (no repeat: no back-off after)
        # The losers stay under DROP_FACTOR with the noise, so that every block runs
        # (1.5625 * 1.05 / 0.95 < 1.75), and a clear win above CLEAR_MARGIN with it
        # (1.4 * 0.95 / 1.05 > 1.25), so that the first win always backs off.
        cost = {m: rng.uniform(1.4, DROP_FACTOR / 1.12) * 1e-2 for m in MODES}
        cost[best] = 1e-2
        ran = _run(trials, cost, rng, explore)
        assert not trials.exploring and trials.chosen == best, (cost, trials.medians())
        # Interleaved: each mode ran in `rotations` separate blocks of `block` steps.
        blocks = [ran[i] for i in range(0, explore, 3)]
        assert all(ran[i : i + 3] == [blocks[i // 3]] * 3 for i in range(0, explore, 3))
        assert sorted(blocks) == sorted(MODES * 2) and blocks[:n] != blocks[n:]
        period = trials.period_now  # (a clear first win backs off: 80)
        assert period == (80 if trials.choices == 1 else 40)
        assert _run(trials, cost, rng, period) == [best] * period  # the chosen mode's period
        assert trials.exploring  # then it measures again
    assert trials.choices == 4


def _measure(trials: SplitTrials, cost: dict[str, float], rng: random.Random) -> int:
    """One whole measurement, then the steps on the chosen mode until the next: their count."""
    while trials.exploring:
        trials.step_done(cost[trials.mode] * rng.uniform(0.99, 1.01))
    steps = 0
    while not trials.exploring:
        trials.step_done(cost[trials.mode])
        steps += 1
    return steps


def test_a_repeated_clear_win_backs_the_period_off_and_anything_else_restores_it(rng_seed):
    """The same mode ahead of every other by CLEAR_MARGIN: the period doubles from the first
    such measurement on (it has nothing to confirm), up to BACKOFF_CAP periods. A close win, or
    another winner, restores the period."""
    rng = random.Random(rng_seed)
    period = rng.randrange(3, 20)
    trials = SplitTrials(block=2, rotations=1, period=period)
    best = rng.choice(MODES)
    clear = {m: rng.uniform(1.05, 2.0) * (1 + CLEAR_MARGIN) for m in MODES}
    clear[best] = 1.0
    doubled = [period * min(2 ** (i + 1), BACKOFF_CAP) for i in range(6)]
    assert [_measure(trials, clear, rng) for _ in range(6)] == doubled
    close = dict(clear)
    close[rng.choice([m for m in MODES if m != best])] = rng.uniform(1.03, 1 + CLEAR_MARGIN - 0.03)
    assert _measure(trials, close, rng) == period and trials.chosen == best
    assert _measure(trials, clear, rng) == 2 * period  # clear again after a kept close win
    other = rng.choice([m for m in MODES if m != best])
    moved = {m: 2.0 for m in MODES}
    moved[other] = 1.0
    assert _measure(trials, moved, rng) == period and trials.chosen == other


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
        assert verdict(gain(-1.0, FETCH_NONE_GAIN)) == "none"


def _bank(tmp_path, rng_seed, slots: int = 9, **trials):
    make_tiny("qwen3_moe", tmp_path, rng_seed, num_experts=16, num_experts_per_tok=6)
    engine = Engine.load(
        tmp_path, device="cpu", policy="adaptive", expert_slots=slots, progress=False
    )
    engine.loaded.bank.adaptive.trial_params = trials
    engine.loaded.bank.adaptive.path_params = {"fixed": "stops"}  # the trials of that path
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
    splits = ("split", "all", "none")  # `layers`: test_layers_mode_keeps_whole_layers
    cases = [(0.0, m, m) for m in splits] * 4 + [(0.9, "none", "all"), (-0.5, "all", "none")] * 2
    for gain, mode, expect in cases:
        bank.cache.fill_gain = gain
        bank.adaptive.trials(1).chosen, bank.adaptive.trials(1)._exploring = mode, False
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
    engine = _bank(tmp_path, rng_seed, slots=20, block=1, rotations=1, period=0)
    resident = Engine.load(tmp_path, device="cpu", policy="resident", progress=False)
    bank, rng = engine.loaded.bank, random.Random(rng_seed)
    # Whether `layers` may pay depends on how many layers this seed's steps stop at (steps
    # that miss in one layer only refuse it); its gate has its own test
    # (test_layers_is_tried_only_where_steps_stop_at_...): here every mode must run.
    bank.adaptive.layers_may_pay = lambda n: True
    prompt = [rng.randrange(engine.spec.vocab_size) for _ in range(40)]
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    seen = []
    trials = bank.adaptive.trials(1)  # one request: decode steps of one token
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


def _log_races(races) -> list[int]:
    """Record the filled lid of every race `races` starts from now on."""
    started, start = [], races.start

    def logged(filled: int, victim: int) -> None:
        started.append(filled)
        start(filled, victim)

    races.start = logged
    return started


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
        started = _log_races(bank.cache.races)
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
        assert bool(started) == races, tokens


def test_layers_mode_keeps_whole_layers(tmp_path, rng_seed):
    """`layers`: entering it keeps the layer holding the most experts (as many layers as the
    slots hold) and fills its missing experts, victims from the other layers only; its misses
    are then always fetched and never evicted by decode's fills (a prefill chunk's may), the
    other layers' run on the CPU (beyond free slots), until it is whole. Another mode's
    fills may break it; coming back keeps a layer again. Results stay exact throughout."""
    rng = random.Random(rng_seed)
    slots = 16 + rng.randrange(16)  # one whole layer of 16 experts, and some to spare
    engine = _bank(tmp_path, rng_seed, slots=slots)
    bank, spec = engine.loaded.bank, engine.spec
    e, k, n_layers = spec.n_experts, spec.top_k, spec.n_moe_layers
    assert n_layers * e > slots
    gen = torch.Generator().manual_seed(rng_seed)
    trials, cache = bank.adaptive.trials(1), bank.cache
    trials._exploring = False

    routed: set[int] = set()  # the lids of the latest call

    def call(layer: int, mode: str, tokens: int = 1) -> tuple[int, int]:
        """`tokens` tokens through `layer` under `mode` (race in band); (misses, fetched)."""
        cache.fill_gain, trials.chosen = 0.0, mode
        ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(tokens)]).int()
        routed.clear()
        routed.update((ids + layer * e).flatten().tolist())
        hidden = torch.randn(tokens, spec.hidden_size, generator=gen)
        weights = torch.rand(tokens, k, generator=gen)
        before = (bank.stats.hits, bank.stats.fetched)
        out = bank(layer, hidden, ids, weights)
        want = fused_moe(hidden, bank.pool.w13, bank.pool.w2, ids + layer * e, weights)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        bank.check_integrity()
        distinct = len(set(ids.flatten().tolist()))
        return distinct - (bank.stats.hits - before[0]), bank.stats.fetched - before[1]

    def resident(layer: int) -> set[int]:
        return {lid for lid in range(layer * e, (layer + 1) * e) if cache.resident(lid)}

    def enter_layers_mode() -> int:
        while True:  # the mode acts at the first call with a miss
            counts = [len(resident(layer)) for layer in range(n_layers)]
            call(rng.randrange(n_layers), "layers")
            if cache.kept_layers:
                (kept,) = cache.kept_layers  # slots // 16 == 1 layer
                assert counts[kept] == max(counts)
                # Filled at once: whole, unless every other resident is this call's.
                others = [lid for lid in cache._lru if lid // e != kept and lid not in routed]
                assert len(resident(kept)) == e or not (others or cache.free_slots)
                return kept

    for _ in range(3 * n_layers):  # fill the cache under `all`: spread over the layers
        call(rng.randrange(n_layers), "all")
    for _ in range(2):
        kept = enter_layers_mode()
        for _ in range(200):
            layer = kept if rng.random() < 0.5 else rng.randrange(n_layers)
            free, had = cache.free_slots, resident(kept)
            misses, fetched = call(layer, "layers")
            assert resident(kept) >= had  # never a victim
            assert fetched == (misses if layer == kept else min(free, misses))
            if len(resident(kept)) == e:
                break
        assert len(resident(kept)) == e
        # A short prefill chunk: experts serving many tokens are fetched, the kept layer's
        # among the victims once the layers passed are taken (victims.py); decode steps
        # in `layers` fetch what it evicted back as routing asks for it.
        other = rng.choice([x for x in range(n_layers) if x != kept])
        call(other, "layers", tokens=48)
        for _ in range(200):
            if len(resident(kept)) == e:
                break
            call(kept, "layers")
        assert len(resident(kept)) == e
        for _ in range(20):  # `all` evicts least recently used experts, the kept layer's too
            call(rng.choice([x for x in range(n_layers) if x != kept]), "all")
        assert not cache.kept_layers


def test_fills_never_evict_a_kept_layer(rng_seed):
    """With `kept_layers` set, a fill takes the least recently used expert outside them even
    when the kept layers' experts are the least recently used of all."""
    from freetoken_agent.engine.experts.cache import ExpertCache
    from freetoken_agent.engine.experts.pool import ExpertPool

    rng = random.Random(rng_seed)
    layers, e = 4, 8
    pool = ExpertPool(torch.randn(layers * e, 2, 2), torch.randn(layers * e, 2, 1))
    spare = rng.randrange(2, 6)
    cache = ExpertCache(pool, e + spare, torch.device("cpu"), lids_per_layer=e)
    kept = rng.randrange(layers)
    cache.fill(list(range(kept * e, (kept + 1) * e)), protect=set())  # oldest in the LRU
    others = [lid for lid in range(layers * e) if lid // e != kept]
    rng.shuffle(others)
    cache.fill(others[:spare], protect=set())  # the slots are full
    cache.kept_layers = frozenset({kept})
    filled = cache.fill(others[spare : 2 * spare], protect=set())
    assert filled == others[spare : 2 * spare]
    assert all(cache.resident(lid) for lid in range(kept * e, (kept + 1) * e))
    assert not any(cache.resident(lid) for lid in others[:spare])  # they were the victims
    torch.testing.assert_close(cache.w13[cache._slot_of[filled[0]]], pool.w13[filled[0]])
    cache.check_integrity()


def test_each_decode_batch_size_measures_its_own_modes(rng_seed):
    """Steps of 1 and 4 tokens interleave (requests join and leave); a 4-token step costs far
    less per token, so one shared measurement would credit whatever ran at batch 4. Each size
    keeps its own trials and finds its own best mode; prefill-sized steps measure nothing."""
    from freetoken_agent.engine.experts.adaptive import AdaptiveFetches
    from freetoken_agent.engine.experts.cache import ExpertCache
    from freetoken_agent.engine.experts.fill_races import RACE_MAX_TOKENS
    from freetoken_agent.engine.experts.pool import ExpertPool

    rng = random.Random(rng_seed)
    pool = ExpertPool(torch.zeros(4 * 8, 2, 2), torch.zeros(4 * 8, 2, 1))
    cache = ExpertCache(pool, 6, torch.device("cpu"), lids_per_layer=8)
    stops = {"fixed": "stops"}  # the stops path's trials
    adaptive = AdaptiveFetches(cache, 4, path_params=stops, block=2, rotations=2, period=1000)
    adaptive.layers_may_pay = lambda n: True  # no layer stops here: test_layers_is_tried_...
    best = {1: rng.choice(MODES), 4: rng.choice(MODES)}
    cost = {n: {m: (1.0 if m == best[n] else rng.uniform(1.3, 2.0)) / n**2 for m in MODES}
            for n in (1, 4)}  # fmt: skip
    for _ in range(400):
        n = rng.choice([1, 4])
        mode = adaptive.trials(n).mode
        adaptive.step_timed(n, n * cost[n][mode] * rng.uniform(0.95, 1.05))
        adaptive.step_timed(RACE_MAX_TOKENS + 1, 1e-6)  # a prefill step: not a sample
    assert {n: adaptive.trials(n).chosen for n in (1, 4)} == best
    assert sorted(adaptive._trials) == [1, 4]


def test_a_refused_mode_is_neither_run_nor_chosen(rng_seed):
    """`allowed` refusing a mode skips its blocks (even where it would be fastest); allowed
    again at the next measurement, it is run and can win."""
    rng = random.Random(rng_seed)
    refused = {rng.choice(MODES[1:])}  # the first block (`split`) always runs
    trials = SplitTrials(block=2, rotations=2, period=10, allowed=lambda m: m not in refused)
    cost = {m: rng.uniform(1.3, DROP_FACTOR / 1.12) for m in MODES}  # none dropped
    (best,) = refused
    cost[best] = 1.0
    ran = _run(trials, cost, rng, 2 * 2 * (len(MODES) - 1))
    assert best not in ran and not trials.exploring and trials.chosen != best
    assert sorted(set(ran)) == sorted(set(MODES) - refused)
    refused.clear()
    _run(trials, cost, rng, 10)  # the period, then a measurement with every mode
    ran = _run(trials, cost, rng, 2 * 2 * len(MODES))
    assert ran.count(best) == 4 and trials.chosen == best


def test_layers_is_tried_only_where_steps_stop_at_more_layers_than_it_leaves(rng_seed):
    """`layers` can only win by stopping at fewer layers. With 4 layers and slots for 2 whole
    ones it leaves 2 layers stopping: where decode steps stop at 1 layer (the working set nearly
    fits) it is never entered; where they stop at all 4 it is measured."""
    from freetoken_agent.engine.experts.adaptive import AdaptiveFetches
    from freetoken_agent.engine.experts.cache import ExpertCache
    from freetoken_agent.engine.experts.pool import ExpertPool

    rng = random.Random(rng_seed)
    per, n_layers = 8, 4
    pool = ExpertPool(torch.zeros(n_layers * per, 2, 2), torch.zeros(n_layers * per, 2, 1))
    bw = Bandwidths(pcie=50e9, cpu=50e9)
    for stopping, tried in ((1, False), (n_layers, True)):
        cache = ExpertCache(pool, 2 * per + rng.randrange(per), torch.device("cpu"),
                            lids_per_layer=per)  # fmt: skip
        stops = {"fixed": "stops"}  # the stops path's trials
        adaptive = AdaptiveFetches(cache, n_layers, path_params=stops, block=2, rotations=2,
                                   period=4)  # fmt: skip
        modes, kept = set(), False
        for _ in range(120):
            cache.fill_gain = 0.0  # in band: the trials choose
            modes.add(adaptive.trials(1).mode)
            for layer in rng.sample(range(n_layers), stopping):
                lid = layer * per + rng.randrange(per)
                if not cache.resident(lid):
                    adaptive.choose([lid], [1], {lid}, bw, 1)
                    kept |= bool(cache.kept_layers)
            adaptive.step_timed(1, rng.uniform(0.9, 1.1) * 1e-2)
        assert ("layers" in modes) == tried == kept, (stopping, modes)


def test_a_candidate_refused_at_its_turns_but_allowed_at_the_end_runs_late_blocks(rng_seed):
    """PathTrials' `shared` waits for the fill race, which only the stops blocks settle: a
    candidate `allowed` refused at each of its turns and allows once the schedule ends runs
    `rotations` blocks then, and can win; one still refused runs none."""
    rng = random.Random(rng_seed)
    for opens in (True, False):
        late = rng.choice(MODES[1:])  # (the schedule's first block always runs)
        flag = {"open": False}

        def allowed(mode: str, late=late, flag=flag) -> bool:
            return mode != late or flag["open"]

        trials = SplitTrials(block=2, rotations=2, period=50, allowed=allowed)
        cost = {m: rng.uniform(1.3, 1.5) * 1e-2 for m in MODES}
        cost[late] = 1e-2
        ran = []
        while trials.exploring:
            if opens and len(ran) == 2 * 2 * (len(MODES) - 1) - 2:  # the last regular block
                flag["open"] = True
            ran.append(trials.mode)
            trials.step_done(cost[trials.mode] * rng.uniform(0.99, 1.01))
        blocks = [ran[i] for i in range(0, len(ran), 2)]
        if opens:
            assert blocks[-2:] == [late, late] and blocks.count(late) == 2
            assert trials.chosen == late
        else:
            assert late not in blocks and trials.chosen != late
        assert sorted(b for b in blocks if b != late) == sorted([m for m in MODES if m != late] * 2)


def test_a_trend_over_a_measurement_favours_no_candidate(rng_seed):
    """Candidates of equal cost on a step time that falls steadily over the measurement (a
    cache warming): their medians agree within the noise, at two rotations and at four, and
    each candidate's blocks sit at the same mean place of the schedule. (Rotated rotations,
    A B C then B C A, gave the last-placed a block's worth of the trend.)"""
    rng = random.Random(rng_seed)
    for rotations in (2, 4):
        block = rng.randint(2, 4)
        trials = SplitTrials(block=block, rotations=rotations, period=10)
        n_steps = len(MODES) * block * rotations
        slope = rng.uniform(0.3, 0.6)  # the first step this much slower than the last
        places: dict[str, list[int]] = {m: [] for m in MODES}
        for step in range(n_steps):
            assert trials.exploring
            places[trials.mode].append(step // block)
            noise = rng.uniform(0.999, 1.001)
            trials.step_done(1e-2 * (1 + slope * (1 - step / n_steps)) * noise)
        assert not trials.exploring
        mean_place = {m: sum(p) / len(p) for m, p in places.items()}
        assert max(mean_place.values()) - min(mean_place.values()) < 1e-9, mean_place
        medians = trials.medians()
        # a block of the trend is slope / (n_modes * rotations) of the step; the medians agree
        # to well within that (each candidate's samples straddle the same middle)
        block_share = slope / (len(MODES) * rotations)
        assert max(medians.values()) / min(medians.values()) - 1 < 0.35 * block_share, (
            rotations, medians)  # fmt: skip
