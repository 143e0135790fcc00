"""Offloaded experts give the resident engine's results under every policy and slot budget.

On the CPU the "GPU" slot cache is a second CPU tensor, so the whole offloading path (pool,
slots, LRU, lid->slot table, fetch decisions, CPU-executed partial sums) runs in CI.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from tiny_models import make_tiny, max_rel_err

from freetoken_agent import Engine, SamplingParams
from freetoken_agent.engine.experts import layer_layout, streaming
from freetoken_agent.engine.experts.graph_io import distinct_lids
from freetoken_agent.engine.experts.offload import OffloadedExpertBank
from freetoken_agent.engine.experts.policy import (
    CPU_KNEE_TOKENS,
    Bandwidths,
    cpu_cost,
    fetch_count,
    split_count,
)
from freetoken_agent.engine.experts.streaming import ring_slots

POLICIES = ("transfer", "cpu", "static", "adaptive", "direct", "gpu-fill")


@pytest.fixture(params=["qwen3_moe", "mixtral", "qwen3_5_moe"])
def model(request, tmp_path, rng_seed):
    make_tiny(request.param, tmp_path, rng_seed)
    resident = Engine.load(tmp_path, device="cpu", policy="resident", progress=False)
    return tmp_path, resident, random.Random(rng_seed)


def test_every_policy_and_budget_matches_resident(model):
    path, resident, rng = model
    spec = resident.spec
    rows = spec.n_moe_layers * spec.n_experts
    # 150 tokens: too many pairs for direct reads, too few to stream (direct fills instead)
    prompts = [[rng.randrange(3, 320) for _ in range(n)] for n in (9, 40, 150)]
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    want_tokens = [o.token_ids for o in resident.generate(prompts, sp)]
    ids = prompts[1] + want_tokens[1]
    want_logits = resident.score(ids)
    for policy in POLICIES:
        for slots in (1, spec.n_experts + 1, rows - 1, rows):
            engine = Engine.load(
                path, device="cpu", policy=policy, expert_slots=slots, progress=False
            )
            got = [o.token_ids for o in engine.generate(prompts, sp)]
            assert got == want_tokens, (policy, slots)
            err = max_rel_err(engine.score(ids), want_logits)
            # fp32: the CPU kernel sums a token's experts in another order, and a hybrid's
            # recurrent layers carry that rounding along the sequence (1.04e-5 seen once).
            assert err <= 3e-5, (policy, slots, err)
            engine.check_integrity()
            st = engine.stats()["experts"]
            if policy in ("adaptive", "direct", "gpu-fill") and slots == rows:  # all fit: resident
                assert st["placement"] == "resident"
                continue
            assert isinstance(engine.loaded.bank, OffloadedExpertBank)
            assert st["slots"] == slots and st["experts_touched"] > 0
            if policy in ("cpu", "static"):
                assert st["fetched"] == 0  # nothing moves after load
            if policy == "transfer" and slots >= spec.n_experts:
                assert st["on_cpu"] == 0  # every miss fits in a slot
            if policy == "static" and slots == rows:
                assert st["miss_rate"] == 0.0  # all layers placed at load
            if policy == "cpu":
                assert st["on_cpu"] == st["experts_touched"] - st["hits"]
            if policy == "direct":  # decode misses read from the pool by the kernels; the
                # 150-token chunk fills its misses (the CPU takes them only when every slot
                # is the layer's own)
                assert st["direct"] < st["experts_touched"] - st["hits"]
                assert st["direct"] > 0 or slots > spec.n_experts + 1  # (nearly all resident)
                assert st["on_cpu"] == 0 or slots < spec.n_experts
                assert st["fetched"] > 0 or slots < spec.n_experts  # the cache learns
            elif policy == "gpu-fill":  # decode's layers fill their own misses; a miss finds
                # no slot only when the layer's own experts hold every one (then it is read
                # from the pool), and the CPU runs only the 150-token chunk's leftovers
                assert st["fetched"] > 0
                assert st["on_cpu"] == 0 or slots < spec.n_experts
                if slots == 1:
                    assert st["direct"] > 0
                assert st["direct"] == 0 or slots <= spec.n_experts
            elif policy == "adaptive":  # its device path (step_paths.py) runs some steps
                assert st["direct"] == 0 or slots <= spec.n_experts
            else:
                assert st["direct"] == 0


def test_adaptive_splits_misses_by_bandwidth():
    bw = Bandwidths(pcie=30e9, cpu=10e9)
    assert fetch_count("adaptive", 8, bw) == 6  # q* = m * B_P / (B_P + B_H)
    assert fetch_count("adaptive", 8, Bandwidths(pcie=1e9, cpu=1e12)) == 0
    assert fetch_count("adaptive", 8, Bandwidths(pcie=1e12, cpu=1e9)) == 8
    assert fetch_count("transfer", 5, bw) == 5 and fetch_count("cpu", 5, bw) == 0
    with pytest.raises(ValueError, match="unknown offload policy"):
        fetch_count("magic", 3, bw)


def test_split_counts_the_cpu_cost_of_many_tokens(rng_seed):
    """Past CPU_KNEE_TOKENS an expert costs the CPU more than one read of its weights: the
    split minimises the slower branch over those costs (checked against every q), fetches the
    experts serving most tokens, and equals q* when every expert serves few tokens."""
    r = random.Random(rng_seed)
    for _ in range(50):
        knee = r.choice([CPU_KNEE_TOKENS, r.uniform(1.0, 40.0)])  # the default or a measured one
        bw = Bandwidths(pcie=r.uniform(5e9, 60e9), cpu=r.uniform(5e9, 60e9), knee=knee)
        m = r.randint(1, 40)
        few = sorted((r.randint(1, max(1, int(knee))) for _ in range(m)), reverse=True)
        assert split_count(few, bw) == fetch_count("adaptive", m, bw)
        many = sorted((r.randint(1, 300) for _ in range(m)), reverse=True)
        if max(many) <= knee:
            continue

        def slower(q: int, t=many, bw=bw) -> float:
            return max(q / bw.pcie, sum(cpu_cost(x, bw.knee) for x in t[q:]) / bw.cpu)

        q = split_count(many, bw)
        assert slower(q) <= min(slower(k) for k in range(m + 1)) * (1 + 1e-12)
    # A 300-token chunk over 128 experts (~19 tokens each), equal bandwidths: the CPU's
    # share shrinks with its per-expert cost (2.3 reads each), q* alone would fetch half.
    bw = Bandwidths(pcie=50e9, cpu=50e9)
    q = split_count([19] * 128, bw)
    assert q > fetch_count("adaptive", 128, bw) and q == round(128 * 2.375 / 3.375)


def test_lru_keeps_the_recent_experts(model):
    path, resident, rng = model
    spec = resident.spec
    engine = Engine.load(
        path, device="cpu", policy="transfer", expert_slots=spec.n_experts, progress=False
    )
    cache = engine.loaded.bank.cache
    engine.generate([rng.randrange(3, 320) for _ in range(30)], SamplingParams(max_tokens=4))
    assert cache.fills > 0
    # One layer's worth of slots shared by every layer: the last layer's experts are resident.
    last = spec.n_moe_layers - 1
    resident_lids = [lid for lid in range(cache.pool.n_rows) if cache.resident(lid)]
    assert resident_lids and any(lid // spec.n_experts == last for lid in resident_lids)
    cache.check_integrity()


@pytest.mark.parametrize("double_buffer", [True, False])
def test_streamed_prefill_matches_resident(model, double_buffer):
    """Chunks of at least stream_min_tokens compute each layer from its resident experts' slots
    and the absent ones streamed through the staging ring."""
    path, resident, rng = model
    spec = resident.spec
    prompt = [rng.randrange(3, 320) for _ in range(60)]
    sp = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    engine = Engine.load(
        path,
        device="cpu",
        policy="transfer",
        expert_slots=spec.n_experts + 1,
        stream_min_tokens=16,
        double_buffer=double_buffer,
        progress=False,
    )
    streamer = engine.loaded.bank.streamer
    assert streamer.n_buffers == (2 if double_buffer else 1)
    assert engine.generate(prompt, sp).token_ids == resident.generate(prompt, sp).token_ids
    assert streamer.layers_streamed >= spec.n_moe_layers  # the prompt streamed every layer
    assert streamer.bytes_h2d > 0
    # Decoding filled slots: the next long chunk reads those experts in place and streams
    # only the others.
    cache = engine.loaded.bank.cache
    absent = sum(slot < 0 for slot in cache.host_slot_of)
    before = streamer.bytes_h2d
    ids = prompt + [rng.randrange(3, 320) for _ in range(30)]
    assert max_rel_err(engine.score(ids), resident.score(ids)) <= 1e-6
    assert 0 < absent < spec.n_moe_layers * spec.n_experts
    assert streamer.bytes_h2d - before == absent * cache.pool.expert_bytes
    engine.check_integrity()


def _routing_stream(kind: str, rng: random.Random, layers: int, experts: int, k: int):
    """Per step and layer, the experts routing asks for: "uniform" (k fresh draws), "local"
    (the layer's set drifts by at most one expert a step) or "thrash" (four uniform tokens)."""
    sets = [rng.sample(range(experts), k) for _ in range(layers)]
    while True:
        for layer in range(layers):
            if kind == "uniform":
                ids = rng.sample(range(experts), k)
            elif kind == "local":
                ids = sets[layer]
                if rng.random() < 0.3:
                    new = rng.choice([e for e in range(experts) if e not in ids])
                    ids[rng.randrange(k)] = new
            else:
                ids = list({e for _ in range(4) for e in rng.sample(range(experts), k)})
            yield [layer * experts + e for e in ids]


@pytest.mark.parametrize(
    ("kind", "slots", "low", "high"),
    [("uniform", 458, -0.1, 0.1), ("local", 458, 0.6, 1.0), ("thrash", 202, -1.0, -0.1)],
)
def test_fill_gain_tells_locality_from_churn(kind, slots, low, high, rng_seed):
    """The cache's race between each fill and its victim reads near 0 under uniform routing,
    high with temporal locality and negative when the working set exceeds the cache (12
    layers x 128 experts, top-8, every miss filled: the `transfer` stream)."""
    import torch

    from freetoken_agent.engine.experts.cache import ExpertCache
    from freetoken_agent.engine.experts.pool import ExpertPool

    layers, experts, k = 12, 128, 8
    pool = ExpertPool(torch.zeros(layers * experts, 2, 2), torch.zeros(layers * experts, 2, 1))
    cache = ExpertCache(pool, slots, torch.device("cpu"), lids_per_layer=experts)
    stream = _routing_stream(kind, random.Random(rng_seed), layers, experts, k)
    for _ in range(300 * layers):
        lids = next(stream)
        cache.touch(lids)
        cache.fill([lid for lid in lids if not cache.resident(lid)], protect=set(lids))
    assert low < cache.fill_gain < high, (kind, cache.fill_gain)
    cache.check_integrity()


def test_adaptive_follows_the_fill_gain(tmp_path, rng_seed):
    """`adaptive` fills free slots with every miss, then fetches all misses when fills win
    their race, q* of them when neither wins, none when victims win; results stay exact."""
    import torch

    from freetoken_agent.kernels.reference import fused_moe

    make_tiny("qwen3_moe", tmp_path, rng_seed, num_experts=16, num_experts_per_tok=6)
    engine = Engine.load(tmp_path, device="cpu", policy="adaptive", expert_slots=9, progress=False)
    bank, spec = engine.loaded.bank, engine.spec
    bank.adaptive.path_params = {"fixed": "stops"}  # the host's decisions: the stops path
    e, k = spec.n_experts, spec.top_k
    gen = torch.Generator().manual_seed(rng_seed)
    bank.bandwidths = Bandwidths(pcie=30e9, cpu=10e9)
    q = fetch_count("adaptive", k, bank.bandwidths)
    assert 0 < q < k

    def step(layer: int) -> tuple[int, int, int]:
        ids = torch.randperm(e, generator=gen)[:k].int()[None]  # [1, K]
        hidden = torch.randn(1, spec.hidden_size, generator=gen)
        weights = torch.rand(1, k, generator=gen)
        before = (bank.stats.fetched, bank.stats.on_cpu, bank.stats.hits)
        free = bank.cache.free_slots
        out = bank(layer, hidden, ids, weights)
        want = fused_moe(hidden, bank.pool.w13, bank.pool.w2, ids + layer * e, weights)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        misses = k - (bank.stats.hits - before[2])
        return bank.stats.fetched - before[0], misses, free

    fetched, misses, _ = step(0)  # an empty cache: free slots take every miss
    assert fetched == misses == k
    modes_differed = 0  # steps where the three modes would have fetched different counts
    for gain, expect in ((0.9, "all"), (0.0, "q"), (-0.5, "none")) * 4:
        bank.cache.fill_gain = gain
        layer = int(torch.randint(spec.n_moe_layers, (1,), generator=gen))
        fetched, misses, free = step(layer)
        want = {"all": misses, "q": fetch_count("adaptive", misses, bank.bandwidths), "none": 0}
        assert fetched == max(want[expect], min(free, misses)), (gain, fetched, misses, free)
        modes_differed += free == 0 and misses > want["q"] > 0
    assert modes_differed > 0
    bank.check_integrity()


@pytest.mark.parametrize("double_buffer", [True, False])
@pytest.mark.parametrize("policy", ["transfer", "static", "adaptive"])
def test_streaming_borrows_cache_slots(tmp_path, rng_seed, double_buffer, policy, monkeypatch):
    """With slots to spare, prefill staging is lent from the cache for the chunk (no buffers
    of its own) and given back afterwards; results stay the resident engine's. Groups of 2
    experts at least, so a chunk from the emptied cache takes wider ones (whole layers) while
    the elastic floor stays the smallest ring's."""
    monkeypatch.setattr(streaming, "STREAM_GROUP", 2)
    make_tiny("qwen3_moe", tmp_path, rng_seed, num_hidden_layers=5)  # 4 MoE layers
    resident = Engine.load(tmp_path, device="cpu", policy="resident", progress=False)
    spec = resident.spec
    buffers = 2 if double_buffer else 1
    slots = (buffers + 1) * spec.n_experts + 3  # lends: a layer's worth stays in service
    assert slots < spec.n_moe_layers * spec.n_experts
    engine = Engine.load(
        tmp_path,
        device="cpu",
        policy=policy,
        expert_slots=slots,
        stream_min_tokens=16,
        double_buffer=double_buffer,
        progress=False,
    )
    bank = engine.loaded.bank
    e, n_layers = spec.n_experts, spec.n_moe_layers
    assert bank.streamer.lend and bank.streamer.nbytes == 0
    assert bank.nbytes == bank.cache.nbytes
    floor = bank.min_slots  # the smallest ring and a layer, whatever ring a chunk took
    assert floor == ring_slots(e, buffers) + e
    rng = random.Random(rng_seed)
    prompt = [rng.randrange(3, 320) for _ in range(60)]
    sp = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    assert engine.generate(prompt, sp).token_ids == resident.generate(prompt, sp).token_ids
    if policy == "static":  # the last layers whole, as many as the slots in service hold,
        # made whole again after the chunk's lend evicted some (decode placed its misses since)
        n = layer_layout.whole_layers(bank.cache)
        assert n == buffers + 1 and bank.cache.kept_layers == set(range(n_layers - n, n_layers))
        assert all(bank.cache.resident(lid) for lid in range((n_layers - n) * e, n_layers * e))
        assert bank.cache.vacates > 0  # a lend emptied slots of the kept layers: refilled
    assert bank.streamer.layers_streamed >= spec.n_moe_layers
    assert bank.cache.lent == 0 and not bank.streamer.borrowing  # given back after the chunk
    assert bank.min_slots == floor
    ids = prompt + [rng.randrange(3, 320) for _ in range(40)]  # streams again, after decoding
    assert max_rel_err(engine.score(ids), resident.score(ids)) <= 1e-6
    engine.check_integrity()


def test_distinct_lids_equals_numpy_unique(rng_seed):
    """The decode path's dedup of a layer's routed lids gives what np.unique does, for one
    token (distinct top-k) and for batches (repeats counted)."""
    rng = np.random.default_rng(rng_seed)
    for _ in range(200):
        t, k, n = int(rng.integers(1, 9)), int(rng.integers(1, 9)), int(rng.integers(8, 300))
        if t == 1 or rng.random() < 0.3:  # rows of distinct experts, as a router gives
            ids = np.stack([rng.choice(n, size=min(k, n), replace=False) for _ in range(t)])
        else:
            ids = rng.integers(0, n, size=(t, k))
        ids = ids.astype(np.int64) + int(rng.integers(0, 40)) * n
        uniq, counts = np.unique(ids, return_counts=True)
        got = distinct_lids(ids)
        assert got == (uniq.tolist(), counts.tolist())
        assert all(type(x) is int for x in got[0] + got[1])


def test_static_keeps_as_many_whole_layers_as_the_slots_hold(tmp_path, rng_seed):
    """`static` keeps the last layers whole, as many as the slots in service hold, and follows
    their count: after the cache shrinks (the elastic split) and grows back, its next steps
    keep fewer, then as many, whole layers again. Results stay the resident engine's."""
    make_tiny("qwen3_moe", tmp_path, rng_seed, num_hidden_layers=5)  # 4 MoE layers
    resident = Engine.load(tmp_path, device="cpu", policy="resident", progress=False)
    spec = resident.spec
    e, n_layers = spec.n_experts, spec.n_moe_layers
    rng = random.Random(rng_seed)
    whole = rng.choice([2, 3])
    slots = whole * e + rng.randrange(e)
    engine = Engine.load(
        tmp_path, device="cpu", policy="static", expert_slots=slots, double_buffer=False,
        progress=False,
    )  # fmt: skip
    bank, cache = engine.loaded.bank, engine.loaded.bank.cache
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

    def run_and_check(n: int) -> None:
        prompt = [rng.randrange(3, 320) for _ in range(rng.randint(5, 40))]
        assert engine.generate(prompt, sp).token_ids == resident.generate(prompt, sp).token_ids
        assert cache.kept_layers == set(range(n_layers - n, n_layers)), (n, cache.kept_layers)
        assert all(cache.resident(lid) for lid in range((n_layers - n) * e, n_layers * e))
        engine.check_integrity()

    run_and_check(whole)
    cache.resize(cache.max_slots - (whole - 1) * e)  # the split takes a layer's slots
    run_and_check(whole - 1)
    cache.resize(0)  # and gives them back
    run_and_check(whole)
    assert bank.stats.on_cpu > 0  # the layers before the kept ones ran on the CPU


def test_every_policy_loads_and_matches_resident_past_128_experts_a_token(tmp_path, rng_seed):
    """top-k above the decode kernels' 128 (token, expert) pairs leaves the device path no
    token to serve (device_tokens 0): adaptive loaded with a ZeroDivisionError in its CPU
    share's set-up. Every policy now loads and gives the resident tokens."""
    rng = random.Random(rng_seed)
    top_k = rng.randint(129, 140)
    n_experts = top_k + rng.randint(1, 30)
    make_tiny("qwen3_moe", tmp_path, rng_seed, num_experts=n_experts,
              num_experts_per_tok=top_k, moe_intermediate_size=8)  # fmt: skip
    resident = Engine.load(tmp_path, device="cpu", policy="resident", progress=False)
    sp = SamplingParams(max_tokens=rng.randint(2, 5), temperature=0, ignore_eos=True)
    prompt = [rng.randrange(3, 320) for _ in range(rng.randint(3, 12))]
    want = resident.generate(prompt, sp).token_ids
    for policy in POLICIES:
        slots = rng.randint(n_experts, 2 * n_experts)  # at least a layer's worth
        engine = Engine.load(tmp_path, device="cpu", policy=policy, expert_slots=slots,
                             progress=False)  # fmt: skip
        assert engine.generate(prompt, sp).token_ids == want, policy


def test_a_model_without_moe_layers_runs_under_every_policy(tmp_path, rng_seed):
    """A MoE family's config whose layers are all dense (decoder_sparse_step past the layer
    count) has no expert to offload: every policy loads and gives the resident tokens (the
    offloading ones failed with an IndexError on the empty bank)."""
    rng = random.Random(rng_seed)
    layers = rng.randint(1, 3)
    make_tiny("qwen3_moe", tmp_path, rng_seed, num_hidden_layers=layers,
              decoder_sparse_step=layers + 1)  # fmt: skip
    resident = Engine.load(tmp_path, device="cpu", policy="resident", progress=False)
    assert resident.spec.n_moe_layers == 0
    sp = SamplingParams(max_tokens=rng.randint(2, 5), temperature=0, ignore_eos=True)
    prompt = [rng.randrange(3, 320) for _ in range(rng.randint(3, 12))]
    want = resident.generate(prompt, sp).token_ids
    for policy in POLICIES:
        engine = Engine.load(tmp_path, device="cpu", policy=policy, progress=False)
        assert engine.generate(prompt, sp).token_ids == want, policy
