"""A prefill chunk's fills evict the layers it has passed before the layers ahead
(victims.py `prefill_victims`): a chunk touches nearly every expert of every layer, so plain
LRU would evict the experts it is about to use."""

import random

import torch
from tiny_models import make_tiny

from freetoken_agent import Engine, SamplingParams
from freetoken_agent.engine.experts import layer_layout
from freetoken_agent.engine.experts.cache import ExpertCache
from freetoken_agent.engine.experts.pool import ExpertPool

L, E, H, I = 5, 8, 4, 2  # noqa: E741 - the shape legend's names


def _cache(seed: int, slots: int) -> ExpertCache:
    g = torch.Generator().manual_seed(seed)
    w13, w2 = torch.randn(L * E, 2 * I, H, generator=g), torch.randn(L * E, H, I, generator=g)
    return ExpertCache(ExpertPool(w13, w2), slots, torch.device("cpu"), lids_per_layer=E)


def test_fills_evict_the_layers_passed_first_then_the_oldest_ahead(rng_seed):
    """Passed layers first, then passed kept layers (decode's whole-layer layout), then the
    layers ahead; least recently used first within each."""
    rng = random.Random(rng_seed)
    for _ in range(20):
        slots = rng.randrange(E, L * E - E)
        cache = _cache(rng_seed, slots)
        cache.fill(rng.sample(range(L * E), slots), protect=set())  # full: fills evict
        cache.touch(rng.sample(range(L * E), L * E))  # an arbitrary LRU order
        cache.kept_layers = frozenset(rng.sample(range(L), rng.randrange(0, 3)))
        layer = rng.randrange(L)
        ahead_from = (layer + 1) * E
        own = range(layer * E, ahead_from)
        protect = {lid for lid in own if rng.random() < 0.6}
        want = [lid for lid in own if not cache.resident(lid) and rng.random() < 0.8]
        order = list(cache._lru)  # oldest first
        free = [lid for lid in order if lid not in protect]
        kept = [lid for lid in free if lid < ahead_from and lid // E in cache.kept_layers]
        passed = [lid for lid in free if lid < ahead_from and lid not in kept]
        expected = (passed + kept + [lid for lid in free if lid >= ahead_from])[: len(want)]
        before = {lid for lid in range(L * E) if cache.resident(lid)}
        filled = cache.fill(want, protect, ahead_from=ahead_from)
        assert filled == want[: len(expected)]
        evicted = before - {lid for lid in range(L * E) if cache.resident(lid)}
        assert evicted == set(expected)
        assert all(cache.resident(lid) for lid in protect & before)
        for lid in filled:
            slot = cache._slot_of[lid]
            assert torch.equal(cache.w13[slot], cache.pool.w13[lid])
        cache.check_integrity()


def _chunk(cache: ExpertCache, passed_first: bool) -> int:
    """One prefill chunk touching every expert of every layer, every miss filled (policy
    transfer); returns its hits."""
    hits = 0
    for layer in range(L):
        uniq = list(range(layer * E, (layer + 1) * E))
        cache.touch(uniq)
        misses = [lid for lid in uniq if not cache.resident(lid)]
        hits += E - len(misses)
        ahead_from = (layer + 1) * E if passed_first else None
        cache.fill(misses, set(uniq), ahead_from=ahead_from)
    return hits


def test_a_chunk_keeps_the_hits_of_the_layers_ahead(rng_seed):
    """Plain LRU turns each fill of a layer into a miss of a layer ahead; evicting the layers
    passed keeps every layer's hits but the first's (whose fills find nothing passed)."""
    rng = random.Random(rng_seed)
    slots = rng.randrange(2 * E, (L - 1) * E)
    caches = {first: _cache(rng_seed, slots) for first in (True, False)}
    start = rng.sample(range(L * E), slots)
    for cache in caches.values():
        cache.fill(start, protect=set())
    hits = {}
    for first, cache in caches.items():
        _chunk(cache, first)  # the previous chunk: the LRU now runs in layer order
        resident = [sum(cache.resident(lid) for lid in range(j * E, (j + 1) * E))
                    for j in range(L)]  # fmt: skip
        hits[first] = _chunk(cache, first)
        cache.check_integrity()
        if first:
            # Layer 0's fills find nothing passed: they evict the oldest of the layers ahead.
            # From layer 1 on, each layer evicts those before it: no other hit is lost.
            lost = min(E - resident[0], sum(resident[1:]))
            assert hits[first] == sum(resident) - lost
    assert hits[True] > hits[False]


def test_a_placed_chunk_in_layers_mode_fills_past_the_other_layers_slots(tmp_path, rng_seed):
    """Adaptive's `layers` mode keeps whole layers for decode; a prefill chunk placed under
    it may evict their experts, so a layer outside them fills more misses than the slots
    outside the kept layers hold (before, the rest ran on the CPU at dozens of tokens each).
    The tokens stay the resident engine's, then through decode steps that fetch the kept
    layers' evicted experts back as routing asks for them."""
    make_tiny("qwen3_moe", tmp_path, rng_seed, num_hidden_layers=5)  # 4 MoE layers, E = 8
    resident = Engine.load(tmp_path, device="cpu", policy="resident", progress=False)
    e, n_layers = resident.spec.n_experts, resident.spec.n_moe_layers
    rng = random.Random(rng_seed)
    slots = 2 * e + rng.randrange(1, 3)  # two whole layers and a few slots more
    engine = Engine.load(tmp_path, device="cpu", policy="adaptive", expert_slots=slots,
                         double_buffer=False, stream_min_tokens=4096,
                         progress=False)  # fmt: skip
    bank, cache = engine.loaded.bank, engine.loaded.bank.cache
    bank.adaptive.verdict = lambda gain: "band"  # fills neither pay nor cost: the trials' band
    cache.kept_layers = layer_layout.kept_layers(cache, n_layers)  # `layers` mode entered
    layer_layout.complete(cache, cache.kept_layers, set())
    outside = slots - len(cache.kept_layers) * e
    fetched: dict[int, int] = {}
    place = bank._place

    def counted(misses, uniq, cpu_inputs, n_tokens, after_compute=True):
        part, filled = place(misses, uniq, cpu_inputs, n_tokens, after_compute)
        if n_tokens > 16:  # the prompt's chunk
            layer = uniq[0] // e
            fetched[layer] = fetched.get(layer, 0) + len(filled)
        return part, filled

    bank._place = counted
    prompt = [rng.randrange(3, 320) for _ in range(rng.randint(150, 250))]
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    assert engine.generate(prompt, sp).token_ids == resident.generate(prompt, sp).token_ids
    assert max(fetched.values()) > outside, (fetched, outside)
    # Decode in `layers` mode with kept layers the chunk left incomplete.
    more = engine.generate(prompt[:5], SamplingParams(max_tokens=24, temperature=0,
                                                      ignore_eos=True))  # fmt: skip
    assert more.token_ids == resident.generate(prompt[:5], SamplingParams(
        max_tokens=24, temperature=0, ignore_eos=True)).token_ids  # fmt: skip
    engine.check_integrity()
