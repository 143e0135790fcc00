"""Synthetic routing regimes: skew and locality do what they say, and an engine runs on them."""

from __future__ import annotations

import numpy as np
from tiny_models import make_tiny

from freetoken_agent import Engine, SamplingParams
from freetoken_agent.bench.routing_traces import Regime, TracedRouting, TraceGenerator


def test_uniform_skewed_and_local_regimes(rng_seed):
    e, k, n = 64, 8, 4000
    uniform = TraceGenerator(1, e, k, Regime(), rng_seed).draw(0, n)
    counts = np.bincount(uniform.ravel(), minlength=e)
    assert counts.max() / counts.mean() < 1.3  # near-uniform
    assert all(len(set(row)) == k for row in uniform)  # k distinct experts per token
    skewed = TraceGenerator(1, e, k, Regime(skew=1.2), rng_seed).draw(0, n)
    top = np.sort(np.bincount(skewed.ravel(), minlength=e))[::-1]
    assert top[: e // 8].sum() > 0.3 * top.sum()  # the top 1/8 of experts get over 30%
    local = TraceGenerator(1, e, k, Regime(locality=0.9), rng_seed).draw(0, n)
    repeats = np.mean([set(a) == set(b) for a, b in zip(local[:-1], local[1:], strict=True)])
    assert 0.85 < repeats < 0.95


def test_regime_names_round_trip():
    r = Regime.parse("zipf:1.1,loc:0.6")
    assert (r.skew, r.locality) == (1.1, 0.6) and r.name == "zipf1.1-loc0.6"
    assert Regime.parse("uniform") == Regime()


def test_locality_lowers_the_miss_rate_of_an_offloaded_engine(tmp_path, rng_seed):
    make_tiny("mixtral", tmp_path, rng_seed)
    rates = {}
    for regime in (Regime(), Regime(locality=0.95)):
        engine = Engine.load(
            tmp_path, device="cpu", policy="transfer", expert_slots=10, progress=False
        )
        bank = engine.loaded.bank
        spec = engine.spec
        gen = TraceGenerator(spec.n_moe_layers, spec.n_experts, spec.top_k, regime, rng_seed)
        engine.loaded.model.set_expert_bank(TracedRouting(bank, gen))
        engine.generate([5, 6, 7], SamplingParams(max_tokens=60, ignore_eos=True))
        rates[regime.name] = bank.stats.miss_rate
        engine.check_integrity()
    assert rates["zipf0-loc0.95"] < rates["zipf0-loc0"] - 0.2, rates


def test_offload_bench_measurements_run_on_a_tiny_engine(tmp_path, rng_seed):
    """The benchmark's decode and prefill measurements, on the CPU, with replayed routing."""
    import random

    from freetoken_agent.bench import offload_decode, offload_limits

    make_tiny("qwen3_moe", tmp_path, rng_seed)
    engine = Engine.load(
        tmp_path, device="cpu", policy="adaptive", expert_slots=4, stream_min_tokens=64,
        progress=False,
    )  # fmt: skip
    spec = engine.spec
    gen = TraceGenerator(spec.n_moe_layers, spec.n_experts, spec.top_k, Regime(1.0, 0.5), 1)
    engine.loaded.model.set_expert_bank(TracedRouting(engine.loaded.bank, gen))
    rng = random.Random(rng_seed)
    rate, st = offload_decode.decode_window(engine, 6, rng, batch=2)
    assert rate > 0 and 0 < st["miss_rate"] <= 1 and st["experts_per_token"] > 0
    assert offload_limits.timed_prefill(engine, 100, rng) > 0  # streamed (100 >= 64 tokens)
    assert engine.loaded.bank.streamer.layers_streamed > 0
    engine.check_integrity()
    # The bench switches policies in place; direct learns after each step, the others not.
    bank = engine.loaded.bank
    offload_decode.use_policy(engine, bank, "direct")
    assert engine.runner.after_step == bank.after_step
    rate, st = offload_decode.decode_window(engine, 6, rng, batch=2)
    assert rate > 0 and bank.stats.direct > 0 and st["miss_rate"] > 0
    offload_decode.use_policy(engine, bank, "adaptive")
    direct = bank.stats.direct
    offload_decode.decode_window(engine, 4, rng, batch=2)
    assert bank.policy == "adaptive" and bank.stats.direct == direct
    engine.check_integrity()
    # One round's measurement of a policy, and the median of the rounds.
    row = offload_decode.measure_policy(engine, bank, "adaptive", 2, 4, rng, 30e9, 10e9)
    assert row["tok_s"] > 0 and bank.policy == "adaptive" and "split_mode" in row
    pins = row["pins"]  # the default EngineConfig.popular_pins, as measured
    assert pins["fraction"] == engine.config.pins_fraction and pins["owned_steps"] >= 0
    assert 0 <= pins["pinned"] <= bank.cache.n_slots and pins["choices"] >= 0
    assert bank.stats.experts > 0
    rates = [rng.uniform(1, 100) for _ in range(rng.choice([3, 4, 5]))]
    median = offload_decode.median_round([{"tok_s": r, "round": i} for i, r in enumerate(rates)])
    assert median["tok_s"] == sorted(rates)[(len(rates) - 1) // 2]
    assert median["tok_s_rounds"] == rates and rates[median["round"]] == median["tok_s"]


def test_each_layer_is_one_stream_however_the_calls_slice_it(rng_seed):
    """Engines that read the routing in different slices (eager steps per layer, graph steps
    for every layer, prefill chunks) see the same tokens, so they are compared on one trace."""
    rng = np.random.default_rng(rng_seed)
    layers, e, k = int(rng.integers(2, 7)), int(rng.integers(16, 64)), int(rng.integers(2, 6))
    regime = Regime(skew=float(rng.uniform(0, 1.3)), locality=float(rng.uniform(0, 0.9)))
    a, b = (TraceGenerator(layers, e, k, regime, rng_seed) for _ in range(2))
    sizes = [int(x) for x in rng.integers(1, 150, size=6)]
    whole = []
    for n in sizes:  # reserving ahead (what a timed measurement does) changes nothing drawn
        if rng.random() < 0.5:
            a.reserve(int(rng.integers(1, 300)))
        whole.append(a.draw_all(n))
    whole = np.concatenate(whole, axis=1)  # [L, T, k]
    for layer in rng.permutation(layers):  # one layer at a time, in other slices
        cuts = np.sort(rng.integers(0, sum(sizes), size=3))
        parts = np.split(np.arange(sum(sizes)), cuts)
        got = np.concatenate([b.draw(int(layer), len(p)) for p in parts])
        assert np.array_equal(got, whole[layer]), layer
    assert all(len(set(row)) == k for row in whole.reshape(-1, k))


def test_choices_follow_successive_draws_without_replacement(rng_seed):
    """The first choice follows the Zipf law itself; a later one the law of what is left (the
    same as Gumbel top-k). E=8, k=3, skew 1: each rank's frequency as first, second and third
    choice within 2% of the exact values."""
    from itertools import permutations

    e, k, n = 8, 3, 60_000
    gen = TraceGenerator(1, e, k, Regime(skew=1.0), rng_seed)
    ranks = np.argsort(gen.order[0])[gen.draw(0, n)]  # expert ids back to popularity ranks
    p = gen.probs
    exact = np.zeros((k, e))
    for seq in permutations(range(e), k):  # P(seq) = prod p_i / (1 - sum of those before)
        prob, left = 1.0, 1.0
        for r in seq:
            prob *= p[r] / left
            left -= p[r]
        for pos, r in enumerate(seq):
            exact[pos, r] += prob
    for pos in range(k):
        seen = np.bincount(ranks[:, pos], minlength=e) / n
        assert np.abs(seen - exact[pos]).max() < 0.02, (pos, seen, exact[pos])


def test_switching_to_a_device_path_makes_the_configured_pins(tmp_path, rng_seed):
    """The benches load under transfer (no pins) and switch policies in place: a device-path
    policy gets EngineConfig.popular_pins' pins, as an engine loaded under it would; a
    fraction of 0 (bench offload --popular-pins 0) gets none."""
    import random

    from freetoken_agent.bench import offload_decode

    make_tiny("qwen3_moe", tmp_path, rng_seed)
    rng = random.Random(rng_seed)
    fraction = round(rng.uniform(0.2, 0.8), 3)
    for chosen in (fraction, 0.0):
        engine = Engine.load(tmp_path, device="cpu", policy="transfer", expert_slots=12,
                             popular_pins=fraction, progress=False)  # fmt: skip
        bank = engine.loaded.bank
        assert bank.popular is None  # transfer makes none
        engine.config.popular_pins = chosen
        offload_decode.use_policy(engine, bank, rng.choice(["gpu-fill", "adaptive"]))
        if chosen:
            assert bank.popular is not None and bank.popular.fraction == chosen
            assert bank.popular.fills is bank.cache.on_device
        else:
            assert bank.popular is None
