"""Popularity pins for the device path's cache (engine/experts/popular_pins.py): each layer's
most used resident experts get PINNED stamps, which no plan evicts; earlier pins no longer
among them get the clock; slots pinned for other reasons stay as they were; the cache comes
back to the host intact; and an engine with pins gives the tokens of one without."""

import random

import pytest
import torch

from freetoken_agent.engine.config import POPULAR_PINS, EngineConfig
from freetoken_agent.engine.experts.cache import ExpertCache
from freetoken_agent.engine.experts.pool import ExpertPool
from freetoken_agent.engine.experts.popular_pins import PopularPins
from freetoken_agent.kernels.expert_fills import copy_fills, plan_fills
from freetoken_agent.kernels.reference_fills import CLOCK, MOVES, PINNED


def _owned_cache(rng: random.Random, layers: int, experts: int, slots: int) -> ExpertCache:
    n, i, h = layers * experts, 3, 4
    pool = ExpertPool(torch.randn(n, 2 * i, h), torch.randn(n, h, i))
    cache = ExpertCache(pool, slots, torch.device("cpu"), lids_per_layer=experts)
    lids = rng.sample(range(n), min(n, slots))
    cache.fill(lids, set(lids))
    cache.on_device.own()
    return cache


def _plan(cache: ExpertCache, pins: PopularPins, layer: int, ids: list[int], experts: int):
    fills = cache.on_device
    rows = plan_fills(torch.tensor(ids, dtype=torch.int32), layer * experts, cache.slot_of,
                      fills.lid_of, fills.stamp, fills.state, fills.moves, len(ids),
                      uses=pins.uses)  # fmt: skip
    copy_fills(fills.state, fills.moves, cache.pool.w13, cache.pool.w2, cache.w13, cache.w2)
    return rows


def test_each_layer_pins_its_most_used_residents(rng_seed):
    rng = random.Random(rng_seed)
    for _ in range(4):
        layers, experts = rng.randrange(2, 5), rng.randrange(4, 12)
        slots = rng.randrange(layers * 2, layers * experts)
        cache = _owned_cache(rng, layers, experts, slots)
        fills = cache.on_device
        pins = PopularPins(fills, experts, rng.uniform(0.2, 0.9))
        for _ in range(rng.randrange(5, 40)):  # skewed visits: low expert ids more often
            layer = rng.randrange(layers)
            ids = sorted({min(int(rng.expovariate(0.4)), experts - 1) for _ in range(3)})
            _plan(cache, pins, layer, ids, experts)
        kept = rng.randrange(cache.max_slots)  # a slot pinned for another reason
        if int(fills.lid_of[kept]) >= 0:
            fills.stamp[kept] = PINNED
        pins.uses.add_(torch.randint(0, 3, pins.uses.shape, dtype=torch.int32))  # break ties
        if int(fills.lid_of[kept]) >= 0:  # the most used of all: pinned already, left alone
            pins.uses[int(fills.lid_of[kept])] = 1000
        stamp_before = fills.stamp.clone()
        chosen = pins.repin()
        assert not chosen[kept] and int(fills.stamp[kept]) == int(stamp_before[kept])
        lid_of, uses = fills.lid_of.tolist(), pins.uses.tolist()
        for layer in range(layers):
            mine = [s for s in range(cache.max_slots) if lid_of[s] >= 0
                    and lid_of[s] // experts == layer and s != kept]  # fmt: skip
            ranked = sorted(mine, key=lambda s: (-uses[lid_of[s]], s))
            want = [s for s in ranked[: int(pins.per_layer())] if uses[lid_of[s]] > 0]
            got = [s for s in mine if chosen[s]]
            assert sorted(got) == sorted(want), layer
            for s in mine:
                assert (int(fills.stamp[s]) == PINNED) == (s in want)
        # A second choice with other counts: the pins that fall out get the clock.
        pins.uses.copy_(torch.randint(0, 50, pins.uses.shape, dtype=torch.int32))
        before = chosen.clone()
        again = pins.repin()
        clock = int(fills.state[CLOCK])
        for s in range(cache.max_slots):
            if before[s] and not again[s]:
                assert int(fills.stamp[s]) == clock
        cache.check_integrity()  # releases: the pinned slots come back resident, as used
        for s in range(cache.max_slots):
            if again[s]:
                assert cache._slot_of[lid_of[s]] == s
                assert cache.clock.last_hit[lid_of[s]] == cache.clock.step


def test_a_pinned_slot_is_never_a_victim(rng_seed):
    """0.99 of 6 slots over 2 layers: 2 pins a layer, 4 in all; each miss takes one of the 2
    slots left (or reads from the host), never a pinned one."""
    rng = random.Random(rng_seed)
    layers, experts = 2, 8
    cache = _owned_cache(rng, layers, experts, 6)
    fills = cache.on_device
    pins = PopularPins(fills, experts, 0.99)
    pins.uses.fill_(5)
    assert int(pins.per_layer()) == 2
    chosen = pins.repin()
    assert int(chosen.sum()) <= 4
    free = [s for s in range(cache.max_slots) if not chosen[s]]
    assert len(free) >= 2
    held = {s: int(fills.lid_of[s]) for s in range(cache.max_slots) if chosen[s]}
    for _ in range(10):
        layer = rng.randrange(layers)
        _plan(cache, pins, layer, rng.sample(range(experts), 3), experts)
        for s, lid in held.items():
            assert int(fills.lid_of[s]) == lid and int(fills.stamp[s]) == PINNED
        moved = fills.moves[: int(fills.state[MOVES])].tolist()
        assert all(slot in free for _, slot in moved)


def test_pins_count_only_steps_the_device_owned(rng_seed):
    rng = random.Random(rng_seed)
    cache = _owned_cache(rng, 2, 6, 8)
    pins = PopularPins(cache.on_device, 6, 0.5, every=3)
    pins.uses.fill_(1)
    for _ in range(2):
        pins.after_step()
    assert not cache.on_device.popular.any()  # two steps: no choice yet
    cache.on_device.release()
    pins.after_step()  # the host's step: not counted
    assert pins.steps == 2
    cache.on_device.own()
    pins.after_step()
    assert pins.steps == 3 and cache.on_device.popular.any()
    cache.on_device.own()  # a no-op while owned: the pins stay
    assert cache.on_device.popular.any()
    cache.on_device.release()
    cache.on_device.own()  # the stamps rebuilt from the host's LRU: no pins
    assert not cache.on_device.popular.any()


def test_kept_layers_count_for_none_of_the_fraction(rng_seed):
    """Slots pinned as kept layers (adaptive's whole-layer layout) are not the plans' to use:
    the pins take their fraction of the others only, so the LRU keeps its share."""
    rng = random.Random(rng_seed)
    layers, experts = 4, 8
    pool = ExpertPool(torch.randn(layers * experts, 6, 4), torch.randn(layers * experts, 4, 3))
    cache = ExpertCache(pool, 2 * experts + 4, torch.device("cpu"), lids_per_layer=experts)
    cache.fill(list(range(2 * experts + 4)), set(range(2 * experts + 4)))  # layers 0, 1, 2
    cache.kept_layers = frozenset({0, 1})
    cache.on_device.own()
    fills = cache.on_device
    pins = PopularPins(fills, experts, 0.8)
    pins.uses.fill_(rng.randint(1, 9))
    usable = int((fills.stamp != PINNED).sum())
    assert usable == 4  # layer 2's residents: the kept layers' 16 slots are PINNED
    assert int(pins.per_layer()) == int(0.8 * usable) // layers
    chosen = pins.repin()
    assert int(chosen.sum()) <= int(0.8 * usable)
    assert int((fills.stamp != PINNED).sum()) >= usable - int(0.8 * usable) > 0


def test_a_hand_back_is_followed_by_a_new_choice(rng_seed):
    """`own` after a hand-back drops the pins; the first owned step after it chooses them
    again from the counts (which survive), not only at the next multiple of `every`."""
    rng = random.Random(rng_seed)
    cache = _owned_cache(rng, 2, 6, 8)
    fills = cache.on_device
    pins = PopularPins(fills, 6, 0.6, every=1000)
    pins.uses.fill_(3)
    pins.after_step()  # the first owned step after construction: no hand-back yet
    assert not fills.popular.any()
    pins.repin()
    assert fills.popular.any()
    fills.release()
    fills.own()
    assert not fills.popular.any()
    pins.after_step()
    assert fills.popular.any() and int(pins.uses[0]) == 3


def test_counts_halve_every_half_life(rng_seed, monkeypatch):
    from freetoken_agent.engine.experts import popular_pins

    rng = random.Random(rng_seed)
    monkeypatch.setattr(popular_pins, "HALF_LIFE", 3)
    cache = _owned_cache(rng, 2, 6, 8)
    pins = PopularPins(cache.on_device, 6, 0.5, every=1000)
    start = torch.randint(0, 100, pins.uses.shape, dtype=torch.int32)
    pins.uses.copy_(start)
    for _ in range(2):
        pins.after_step()
    assert torch.equal(pins.uses, start)
    pins.after_step()
    assert torch.equal(pins.uses, start // 2)


@pytest.mark.parametrize("fraction", [-0.1, 1.0, 1.5])
def test_a_fraction_outside_0_1_is_refused(fraction):
    with pytest.raises(ValueError, match="popular_pins"):
        EngineConfig(popular_pins=fraction)


def test_pins_warn_only_when_asked_for_under_a_policy_without_device_paths(
    tmp_path, rng_seed, caplog
):
    """On by default for every policy: only a fraction the user chose warns that transfer,
    cpu, static and direct ignore it; gpu-fill and adaptive never warn, and get pins."""
    from tiny_models import make_tiny

    from freetoken_agent import Engine

    make_tiny("qwen3_moe", tmp_path, rng_seed)
    rng = random.Random(rng_seed)
    chosen = round(rng.uniform(0.1, 0.7), 3)
    spec = Engine.load(tmp_path, device="cpu", policy="resident", progress=False).spec
    slots = rng.randrange(spec.n_experts + 1, spec.n_moe_layers * spec.n_experts - 1)
    for policy, fraction, warns in [
        (rng.choice(["transfer", "cpu", "static"]), None, False),
        (rng.choice(["transfer", "cpu", "static"]), chosen, True),
        # The default's value, chosen: still the user's choice, still without effect.
        (rng.choice(["transfer", "cpu", "static"]), POPULAR_PINS, True),
        (rng.choice(["gpu-fill", "adaptive"]), None, False),
        (rng.choice(["gpu-fill", "adaptive"]), chosen, False),
    ]:
        caplog.clear()
        opts = {} if fraction is None else {"popular_pins": fraction}
        engine = Engine.load(tmp_path, device="cpu", policy=policy, expert_slots=slots,
                             progress=False, **opts)  # fmt: skip
        said = [r.getMessage() for r in caplog.records if "popular_pins" in r.getMessage()]
        assert bool(said) == warns, (policy, fraction, said)
        pins = engine.loaded.bank.popular
        if policy in ("gpu-fill", "adaptive"):
            want = POPULAR_PINS if fraction is None else fraction
            assert pins is not None and pins.fraction == want
        else:
            assert pins is None


@pytest.mark.parametrize("policy", ["gpu-fill", "adaptive"])
def test_an_engine_with_pins_gives_the_resident_tokens(policy, tmp_path, rng_seed):
    """A tiny model on the CPU, decode on the device path with pins chosen every 2 steps: the
    greedy tokens and logits of the resident engine, and the cache whole afterwards."""
    from tiny_models import make_tiny

    from freetoken_agent import Engine, SamplingParams

    make_tiny("qwen3_moe", tmp_path, rng_seed)
    rng = random.Random(rng_seed)
    prompts = [[rng.randrange(3, 320) for _ in range(n)] for n in (7, 30)]
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    resident = Engine.load(tmp_path, device="cpu", policy="resident", progress=False)
    want = [o.token_ids for o in resident.generate(prompts, sp)]
    spec = resident.spec
    slots = rng.randrange(spec.n_experts + 1, spec.n_moe_layers * spec.n_experts - 1)
    engine = Engine.load(tmp_path, device="cpu", policy=policy, expert_slots=slots,
                         popular_pins=rng.uniform(0.3, 0.8), progress=False)  # fmt: skip
    bank = engine.loaded.bank
    bank.popular.every = 2
    chosen = []
    repin = bank.popular.repin
    bank.popular.repin = lambda: chosen.append(int(repin().sum())) or None
    got = [o.token_ids for o in engine.generate(prompts, sp)]
    assert got == want
    if policy == "gpu-fill":  # adaptive's device path runs only the steps its trials give it
        assert chosen and max(chosen) > 0, "no step pinned anything"
    ids = prompts[1] + want[1]
    torch.testing.assert_close(engine.score(ids), resident.score(ids), atol=3e-5, rtol=3e-5)
    engine.check_integrity()
    assert int(bank.popular.uses.sum()) > 0 or policy == "adaptive"
    assert bank.popular.choices == len(chosen)  # what the benchmark reports
    bank.reset_decisions()  # the benchmark, between measurements: the counts start again
    assert int(bank.popular.uses.sum()) == 0 and bank.popular.steps == 0
    assert bank.popular.choices == 0


@pytest.mark.gpu
def test_pins_under_captured_graphs_give_the_resident_tokens(tmp_path, rng_seed):
    """CUDA (device machine): gpu-fill decoding in its captured whole-step graphs, the Triton
    plan counting uses, pins chosen every 2 steps: the resident engine's tokens and logits
    (fp32), pins taken, the cache whole."""
    from tiny_models import make_tiny

    from freetoken_agent import Engine, SamplingParams

    make_tiny("qwen3_moe", tmp_path, rng_seed, num_experts=16, num_experts_per_tok=4)
    rng = random.Random(rng_seed)
    prompts = [[rng.randrange(3, 320) for _ in range(n)] for n in (5, 40)]
    sp = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    opts = dict(device="cuda", progress=False, max_model_len=512, max_num_seqs=4)
    resident = Engine.load(tmp_path, policy="resident", **opts)
    want = [o.token_ids for o in resident.generate(prompts, sp)]
    engine = Engine.load(tmp_path, policy="gpu-fill", expert_slots=rng.randint(14, 30),
                         popular_pins=0.6, **opts)  # fmt: skip
    bank = engine.loaded.bank
    bank.popular.every = 2
    repin = bank.popular.repin

    def repin_without_sync():  # between steps, under overlap scheduling: it must not sync
        torch.cuda.set_sync_debug_mode("error")
        try:
            return repin()
        finally:
            torch.cuda.set_sync_debug_mode("default")

    bank.popular.repin = repin_without_sync
    assert [o.token_ids for o in engine.generate(prompts, sp)] == want
    assert int(bank.popular.uses.sum()) > 0 and bank.popular.steps > 2
    assert bool(bank.cache.on_device.popular.any()), "no step pinned anything"
    ids = prompts[1] + want[1]
    torch.testing.assert_close(engine.score(ids), resident.score(ids), atol=3e-5, rtol=3e-5)
    engine.check_integrity()
    engine.close()
    resident.close()
