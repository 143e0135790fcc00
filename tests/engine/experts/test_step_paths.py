"""adaptive's step paths (engine/experts/step_paths.py): the trials' schedule and choice, and
an engine alternating between the host's stops and the device's own fills every other step
gives the resident engine's tokens with the cache's host mirror intact."""

import random
from types import SimpleNamespace

import pytest
from tiny_models import make_tiny

from freetoken_agent import Engine, SamplingParams
from freetoken_agent.engine.experts.fill_races import MIN_RACES
from freetoken_agent.engine.experts.split_trials import CLEAR_MARGIN, DROP_FACTOR
from freetoken_agent.engine.experts.step_paths import PATHS, PathTrials


@pytest.mark.parametrize(("shared", "split"), [(False, False), (True, False), (False, True),
                                               (True, True)])  # fmt: skip
def test_trials_time_the_paths_and_keep_the_fastest(rng_seed, shared, split):
    rng = random.Random(rng_seed)
    block, rotations, period = rng.randrange(2, 5), rng.randrange(1, 3), rng.randrange(1, 9)
    trials = PathTrials(block, rotations, period, warm=0, shared=shared, split=split)
    offered = {"shared": shared, "split": split}
    paths = tuple(p for p in PATHS if offered.get(p, True))
    # Costs in random order, at least 5% apart: the 1% noise below never reorders them (two
    # paths 0.1% apart made the choice a coin toss once); all within DROP_FACTOR of the
    # fastest, so every path runs every rotation (four paths at 0.25 apart once put the
    # slowest past it, and its later blocks were dropped).
    cost = {
        p: 1.0 + 0.15 * i + rng.uniform(0.0, 0.1)
        for i, p in enumerate(rng.sample(paths, len(paths)))
    }
    assert max(cost.values()) < DROP_FACTOR * min(cost.values())
    ran = []
    for _ in range(len(paths) * block * rotations):
        assert trials.exploring
        ran.append(trials.path)
        trials.step_done(cost[trials.path] * rng.uniform(0.99, 1.01))
    assert not trials.exploring and trials.choices == 1
    assert trials.chosen == min(paths, key=cost.get)
    assert {p: ran.count(p) for p in PATHS} == {
        p: block * rotations if p in paths else 0 for p in PATHS
    }
    # a block's first step is not a sample: block - 1 a block
    assert all(len(s) == (block - 1) * rotations for s in trials._samples.values())
    # The period, twice as long after a clear first win (the back-off: split_trials.py).
    measured = trials.medians()
    best = measured[trials.chosen]
    clear = min(t for p, t in measured.items() if p != trials.chosen) >= (1 + CLEAR_MARGIN) * best
    assert trials.period_now == (2 * period if clear else period), (measured, period)
    for _ in range(trials.period_now):
        assert trials.path == trials.chosen
        trials.step_done(1.0)
    assert trials.exploring  # measured again after the period


def test_the_first_measurement_waits_for_a_warm_cache(rng_seed):
    warm = random.Random(rng_seed).randrange(1, 20)
    trials = PathTrials(block=2, rotations=1, period=5, warm=warm)
    for _ in range(warm):  # on the device path (the stops path measured slower everywhere)
        assert trials.path == "device" and not trials.exploring
        trials.step_done(1.0)
    assert trials.exploring and trials.path == "stops" and trials._at == 0


def test_the_first_step_of_a_block_is_not_a_sample():
    """A handoff's cost, or under overlap the last step of the block before: a huge first step
    of every block does not move the choice."""
    trials = PathTrials(block=3, rotations=2, period=5, warm=0)
    # (path, first of its block): counted, the first steps would make `stops` win
    cost = {("stops", True): 0.1, ("stops", False): 2.0, ("device", True): 100.0,
            ("device", False): 1.0, ("shared", True): 100.0, ("shared", False): 1.5}  # fmt: skip
    while trials.exploring:
        trials.step_done(cost[trials.path, trials._at % trials.block == 0])
    assert trials.chosen == "device"


def test_fixed_and_bad_parameters():
    trials = PathTrials(fixed="device")
    for _ in range(40):
        assert trials.path == "device"
        trials.step_done(1.0)
    for bad in (dict(block=1), dict(rotations=0), dict(period=-1), dict(warm=-1),
                dict(fixed="gpu")):  # fmt: skip
        with pytest.raises(ValueError, match="path trials need"):
            PathTrials(**bad)


@pytest.mark.parametrize("overlap", [False, True])
def test_alternating_paths_keep_the_tokens(tmp_path, rng_seed, overlap):
    make_tiny("qwen3_moe", tmp_path, rng_seed, num_experts=16, num_experts_per_tok=4)
    rng = random.Random(rng_seed)
    prompts = [[rng.randrange(3, 320) for _ in range(n)] for n in (rng.randint(5, 30), 40)]
    sp = SamplingParams(max_tokens=rng.randint(12, 20), temperature=0, ignore_eos=True)
    opts = dict(device="cpu", progress=False, dtype="float32", overlap_schedule=overlap)
    want = [o.token_ids for o in Engine.load(tmp_path, policy="resident", **opts).generate(
        prompts, sp)]  # fmt: skip
    engine = Engine.load(tmp_path, policy="adaptive", expert_slots=rng.randint(5, 30), **opts)
    bank = engine.loaded.bank
    bank.adaptive.path_params = dict(block=2, rotations=1, period=0, warm=0)  # switch every 2
    bank.adaptive.verdict = lambda gain: "all"  # fills pay: no split trials hold the path
    got = [o.token_ids for o in engine.generate(prompts, sp)]
    assert got == want
    fills = bank.cache.on_device
    assert fills.releases >= 1  # the device path ran, and handed the cache back
    st = engine.stats()["experts"]
    assert st["fetched"] > 0 and st["experts_touched"] > 0
    assert st["cache_handoffs"] == fills.releases and set(st["step_paths"]) <= {1, 2}
    assert set(st["step_paths"].values()) <= set(PATHS) and st["step_paths"]
    engine.check_integrity()


def test_the_stops_path_is_timed_at_its_best_mode(tmp_path, rng_seed):
    """While the path trials measure, the stops path runs its split trials' chosen mode (not
    their next trial) and the split trials take no sample; between path measurements, the
    stops path's split trials explore on its steps."""
    make_tiny("qwen3_moe", tmp_path, rng_seed, num_experts=16, num_experts_per_tok=4)
    engine = Engine.load(tmp_path, device="cpu", policy="adaptive", expert_slots=20,
                         progress=False)  # fmt: skip
    adaptive = engine.loaded.bank.adaptive
    adaptive.trial_params = dict(block=1, rotations=1, period=50)
    adaptive.path_params = dict(block=2, rotations=1, period=50, warm=0)
    adaptive.verdict = lambda gain: "band"
    adaptive.fills_judged = lambda: True  # the race has spoken: shared may run
    adaptive.layers_may_pay = lambda n: True  # every split mode tried: one step each
    split, paths = adaptive.trials(1), adaptive.paths(1)
    split.chosen = "none"
    modes, seen = [], []
    while paths.exploring:
        seen.append(adaptive.path(1))
        adaptive.choose([1, 2], [1, 1], {1, 2}, engine.loaded.bank.bandwidths, 1)
        modes.append(adaptive.mode)
        adaptive.step_timed(1, 0.02 if seen[-1] != "stops" else 0.01)
    device_paths = [p for p in paths.candidates[1:] for _ in range(2)]  # blocks of 2
    assert seen == ["stops", "stops", *device_paths] and paths.chosen == "stops"
    assert set(modes) == {"none"} and split._at == 0  # the chosen mode; no split sample
    tried = []
    while split.exploring:  # the stops path kept: its split trials now explore
        assert adaptive.path(1) == "stops"
        adaptive.choose([1, 2], [1, 1], {1, 2}, engine.loaded.bank.bandwidths, 1)
        tried.append(adaptive.mode)
        adaptive.step_timed(1, 0.01)
    assert tried == ["split", "all", "none", "layers"]


def test_steps_past_the_device_paths_tokens_stop(rng_seed):
    """The device path serves decode steps whose pairs the kernels' pool reads take
    (`device_tokens`: 128 pairs); larger steps take the stops path and measure no path."""
    from freetoken_agent.engine.experts.adaptive import AdaptiveFetches

    rng = random.Random(rng_seed)
    device_tokens = rng.randrange(1, 8)
    adaptive = AdaptiveFetches(None, 4, device_tokens, path_params={"fixed": "device"})
    adaptive.verdict = lambda gain: "all"  # (the race is not read past the verdict)
    for n in range(1, 17):
        assert adaptive.path(n) == ("device" if n <= device_tokens else "stops")
    adaptive.cache = type("Cache", (), {"kept_layers": frozenset(), "fill_gain": 0.5})()
    adaptive.step_timed(device_tokens + 1, 0.01)
    assert sorted(adaptive._paths) == list(range(1, device_tokens + 1))


def test_shared_is_measured_and_kept_whether_fills_pay_or_not(rng_seed):
    """Once the race has judged, the shared path is measured and kept when fastest whatever
    the verdict (adaptive.py `_path_allowed`: its CPU share never takes all of a layer's
    misses and takes the least used, so the cache keeps learning under locality); it loses
    to a faster path as any path does."""
    from freetoken_agent.engine.experts.adaptive import AdaptiveFetches

    rng = random.Random(rng_seed)
    for pay, shared_fastest in ((True, True), (False, True), (True, False)):
        cache = fake_cache(settled=MIN_RACES + rng.randrange(100))
        adaptive = AdaptiveFetches(cache, 4, 8, path_params=dict(block=2, rotations=2,
                                                                     period=9, warm=0))  # fmt: skip
        adaptive.shared_ok = True
        adaptive.verdict = lambda gain, pay=pay: "all" if pay else "band"
        fast = rng.uniform(0.5, 0.9)
        ran = []
        while adaptive.paths(1).exploring:
            ran.append(adaptive.path(1))
            shared = ran[-1] == "shared"
            adaptive.step_timed(1, 1e-3 * (fast if shared == shared_fastest else 1.0))
        assert "shared" in ran, pay
        assert (adaptive.paths(1).chosen == "shared") == shared_fastest, (pay, shared_fastest)
        assert (adaptive.path(1) == "shared") == shared_fastest


def test_shared_waits_for_the_race_to_judge(rng_seed):
    """Before MIN_RACES fill races have settled the race's gain reads 0 (not "fills pay"),
    yet shared is neither measured nor run: its CPU share starts no race, so where misses are
    rare the race would never judge and the cache would stop learning. Once judged, shared
    is measured and kept when it is fastest."""
    from freetoken_agent.engine.experts.adaptive import AdaptiveFetches

    rng = random.Random(rng_seed)
    cache = fake_cache(settled=rng.randrange(MIN_RACES))
    adaptive = AdaptiveFetches(cache, 4, 8, path_params=dict(block=2, rotations=1, period=9,
                                                                 warm=0))  # fmt: skip
    adaptive.shared_ok = True
    adaptive.verdict = lambda gain: "band"  # fills do not pay, as far as the gain says
    ran = []
    while adaptive.paths(1).exploring:
        ran.append(adaptive.path(1))
        adaptive.step_timed(1, 0.001 if ran[-1] == "shared" else 0.002)
    assert "shared" not in ran
    adaptive.paths(1).chosen = "shared"
    assert adaptive.path(1) == "device"
    cache.races.settled = MIN_RACES
    assert adaptive.path(1) == "shared"


def fake_cache(settled: int):
    """What AdaptiveFetches reads of an ExpertCache in these tests."""
    races = SimpleNamespace(settled=settled)
    return SimpleNamespace(kept_layers=frozenset(), fill_gain=0.0, races=races)


def test_without_the_gate_shared_is_measured_and_kept_while_fills_pay(rng_seed):
    """`shared_gate` off (bench offload --no-shared-gate, to measure shared under locality):
    fills paying neither skips its blocks nor turns a kept `shared` into `device`."""
    from freetoken_agent.engine.experts.adaptive import AdaptiveFetches

    rng = random.Random(rng_seed)
    cache = fake_cache(settled=0)  # the gate off: the race is not asked
    block, rotations = rng.randrange(2, 5), rng.randrange(1, 3)
    adaptive = AdaptiveFetches(cache, 4, 8, path_params=dict(block=block, rotations=rotations,
                                                                 period=9, warm=0))  # fmt: skip
    adaptive.shared_ok, adaptive.shared_gate = True, False
    adaptive.verdict = lambda gain: "all"  # fills pay
    ran = []
    while adaptive.paths(1).exploring:
        ran.append(adaptive.path(1))
        adaptive.step_timed(1, 0.001 if ran[-1] == "shared" else 0.002)
    assert ran.count("shared") == block * rotations
    assert adaptive.paths(1).chosen == "shared" and adaptive.path(1) == "shared"


def test_without_a_device_path_adaptive_stays_on_its_stops(tmp_path, rng_seed):
    """A pool that could not be pinned has no device path (its kernels read the pool over the
    link): no path trials, every decode step on the stops path, from load or a reset."""
    make_tiny("qwen3_moe", tmp_path, rng_seed, num_experts=16, num_experts_per_tok=4)
    engine = Engine.load(tmp_path, device="cpu", policy="adaptive", expert_slots=5,
                         progress=False)  # fmt: skip
    bank = engine.loaded.bank
    assert bank.adaptive.path_measured(1) and bank.adaptive.path(1) == "device"  # warming
    bank.device_path_ok = False  # as `ready` leaves it when pinning failed
    bank.reset_decisions()
    for n in range(1, 5):
        assert not bank.adaptive.path_measured(n) and bank.adaptive.path(n) == "stops"


def test_a_path_far_behind_runs_no_more_blocks(rng_seed):
    """A path whose median is already DROP_FACTOR times another's is not run again in that
    measurement (on the H200 the Zipf stops path took 21 ms a token against 2.9); one just
    inside the factor is run in every rotation. Either way the fastest is kept."""
    from freetoken_agent.engine.experts.split_trials import DROP_FACTOR

    rng = random.Random(rng_seed)
    block, rotations = rng.randrange(2, 5), rng.randrange(2, 4)
    base = rng.uniform(1.0, 2.0)
    for factor, dropped in ((DROP_FACTOR * 1.1, True), (DROP_FACTOR * 0.9, False)):
        trials = PathTrials(block, rotations, period=9, warm=0, shared=False)
        cost = {"device": base, "stops": base * factor}
        ran = []
        while trials.exploring:
            ran.append(trials.path)
            trials.step_done(cost[trials.path] * rng.uniform(0.99, 1.01))
        assert trials.chosen == "device"
        assert ran.count("device") == block * rotations
        # the stops path leads the first rotation, so it is measured before the device path
        # and its next block comes after the device path's first
        assert ran.count("stops") == (block if dropped else block * rotations), factor


def test_stops_is_measured_but_not_kept_while_fills_pay(rng_seed):
    """Once the race has judged that fills pay, one block of the stops path still runs each
    measurement (its steps are the races' only source; its later blocks only cost) but a
    measurement keeps the fastest other path, even where
    stops measured faster; with fills not paying, or the race not yet judged, the fastest
    path is kept, stops included. A faster stops path that may not be kept is no clear win:
    the period does not back off."""
    from freetoken_agent.engine.experts.adaptive import AdaptiveFetches

    rng = random.Random(rng_seed)
    block, rotations = rng.randrange(2, 5), rng.randrange(2, 4)  # (two: a block to skip)
    for pay, judged in ((True, True), (False, True), (True, False)):
        settled = MIN_RACES + rng.randrange(100) if judged else rng.randrange(MIN_RACES)
        cache = fake_cache(settled)
        # no whole layer fits: the stops path's split trials never try `layers`
        cache.n_slots, cache.lent, cache.lids_per_layer = 0, 0, 16
        adaptive = AdaptiveFetches(cache, 4, 8, path_params=dict(
            block=block, rotations=rotations, period=9, warm=0))  # fmt: skip
        adaptive.verdict = lambda gain, pay=pay: "all" if pay else "band"
        adaptive.split_ok = True  # a third path, clearly behind device (past CLEAR_MARGIN)
        # stops the fastest, all within DROP_FACTOR: no path is dropped as far behind
        cost = {"stops": rng.uniform(1.1, 1.2), "device": rng.uniform(1.3, 1.4)}
        cost["split"] = 1.3 * cost["device"]
        for _ in range(3):  # three measurements: a clear win twice running would back off
            ran = []
            while adaptive.paths(1).exploring:
                ran.append(adaptive.path(1))
                adaptive.step_timed(1, 1e-3 * cost[ran[-1]] * rng.uniform(0.99, 1.01))
            kept_stops = not (pay and judged)
            # every block of every path, but one of a stops path that may not be kept (its
            # later blocks only cost; the first feeds the races)
            runs = dict.fromkeys(cost, block * rotations)
            runs["stops"] = block * rotations if kept_stops else block
            assert {p: ran.count(p) for p in cost} == runs
            trials = adaptive.paths(1)
            assert trials.chosen == ("stops" if kept_stops else "device")
            assert adaptive.path(1) == trials.chosen
            for _ in range(trials.period_now):
                adaptive.step_timed(1, 1e-3 * cost[adaptive.path(1)])
        if not kept_stops:
            assert trials.period_now == 9  # never backed off
