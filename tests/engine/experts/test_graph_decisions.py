"""The offloaded bank's graph-decode protocol, on the CPU.

Under captured decode graphs (engine/segmented_graphs.py) a MoE layer runs as: the graph
exports routing and activations (`_captured`, first half), the host places the misses
(`resolve`), and the next segment sums the experts from slots plus the CPU's part (`_captured`,
second half), running again when the layer missed. Here each half runs eagerly on CPU tensors,
so the decisions, the CPU partial sums and the buffers' life cycle are checked in CI; the
device test (test_offload_gpu.py) replays real graphs. The replay loop's ordering is checked
with recorded fake segments.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from tiny_models import make_tiny

from freetoken_agent import Engine
from freetoken_agent.engine.segmented_graphs import SegmentedDecodeGraphs
from freetoken_agent.kernels.reference import fused_moe


def graph_bank(tmp_path, seed: int, policy: str, slots: int):
    """A tiny offloaded bank with its graph buffers, recording as under capture: (bank, spec,
    GraphIO)."""
    make_tiny("qwen3_moe", tmp_path, seed)
    engine = Engine.load(tmp_path, device="cpu", policy=policy, expert_slots=slots, progress=False)
    io = engine.loaded.bank.attach_graph_io(max_tokens=4, dtype=torch.float32)
    io.active = True
    return engine.loaded.bank, engine.spec, io


@pytest.mark.parametrize("policy", ["transfer", "cpu", "static", "adaptive"])
@pytest.mark.parametrize("slots", [1, 9])
def test_export_resolve_rerun_matches_resident(policy, slots, tmp_path, rng_seed):
    bank, spec, io = graph_bank(tmp_path, rng_seed, policy, slots)
    e, k, h = spec.n_experts, spec.top_k, spec.hidden_size
    gen = torch.Generator().manual_seed(rng_seed)
    rng = random.Random(rng_seed)
    missed_any = hit_any = False
    for i in range(40):
        layer, t = rng.randrange(spec.n_moe_layers), rng.randint(1, 4)
        ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).int()
        resident = [x for x in range(e) if bank.cache.resident(layer * e + x)]
        if i % 4 == 3 and len(resident) >= k:  # a token routed to cached experts (locality):
            t, ids = 1, torch.tensor([rng.sample(resident, k)]).int()  # random draws alone
            # left some seeds (53 of 0-149, adaptive at 9 slots) with no hit in 40 calls
        hidden = torch.randn(t, h, generator=gen)
        weights = torch.rand(t, k, generator=gen)
        want = fused_moe(hidden, bank.pool.w13, bank.pool.w2, ids + layer * e, weights)
        first = bank(layer, hidden, ids, weights)  # the speculative segment
        assert torch.equal(io.ids[layer, :t], ids) and torch.equal(io.hidden[layer, :t], hidden)
        missed = bank.resolve(layer, t)
        again = bank(layer, hidden, ids, weights)  # the segment after resolve
        torch.testing.assert_close(again, want, rtol=1e-5, atol=1e-5)
        if missed:
            missed_any = True
        else:
            hit_any = True
            assert torch.equal(first, again)  # nothing changed: the bet was right
        assert not io.cpu_part.any()  # each segment clears the CPU part it consumed
        bank.check_integrity()
    assert missed_any  # one or nine slots cannot hold every layer's experts
    if policy in ("cpu", "static") and slots == 1:
        assert bank.stats.fetched == 0 and bank.stats.on_cpu > 0
    if policy == "transfer":
        assert bank.stats.on_cpu == 0 or slots == 1  # one slot cannot hold a layer's misses
    assert hit_any or slots == 1 or policy == "cpu"  # `cpu` never fills a slot


@pytest.mark.parametrize("whole", ["gpu-fill", "adaptive", "adaptive-shared"])
def test_whole_step_layers_fill_only_the_real_rows(whole, tmp_path, rng_seed):
    """A whole-step graph's layer (gpu-fill, or adaptive's device or shared path while its
    whole set captures): the plan reads the step's real pair count from the device state that
    `before_whole_step` wrote, so padded rows plan nothing and add nothing; the real rows are
    the pool's experts' sum; the mirror, released after, passes the integrity check. The
    shared set's layers post the CPU worker half of their misses and add its answer."""
    policy = whole.removesuffix("-shared")
    bank, spec, io = graph_bank(tmp_path, rng_seed, policy, rng_seed % 9 + 1)
    e, k, h = spec.n_experts, spec.top_k, spec.hidden_size
    gen = torch.Generator().manual_seed(rng_seed)
    rng = random.Random(rng_seed)
    bank.whole_step_capture = True  # as DirectDecodeGraphs captures
    if whole == "adaptive-shared":
        if bank.cpu_share is None:
            pytest.skip("no SIMD expert kernel here: no CPU worker, no shared set")
        bank.device_path.capture_share = True  # as the shared set captures
        bank.adaptive.path_params = {"fixed": "shared"}
        bank.adaptive.shared_gate = False  # the path itself, not when adaptive allows it
        bank.bandwidths.cpu = bank.bandwidths.pcie = 1.0  # a share of one half
        bank.cpu_share.observe = lambda bandwidths: None  # keep it
    pairs = 0
    for _ in range(20):
        real, padded = rng.randint(1, 4), 4
        bank.before_whole_step(real)
        layer = rng.randrange(spec.n_moe_layers)
        ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(padded)]).int()
        hidden, weights = torch.randn(padded, h, generator=gen), torch.rand(padded, k)
        got = bank(layer, hidden, ids, weights)
        want = fused_moe(hidden[:real], bank.pool.w13, bank.pool.w2, ids[:real] + layer * e,
                         weights[:real])  # fmt: skip
        torch.testing.assert_close(got[:real], want, rtol=1e-5, atol=1e-5)
        assert not got[real:].any()  # padded rows: every pair skipped
        pairs += real * k
    assert bank.stats.pairs == pairs and bank.stats.fetched > 0
    if whole == "adaptive-shared":
        assert bank.stats.on_cpu > 0  # the worker computed some of the misses
    bank.check_integrity()


class _Segment:
    def __init__(self, k: int, log: list, shadow=None) -> None:
        self.k, self.log, self.shadow = k, log, shadow

    def replay(self) -> None:
        self.log.append(("run", self.k))
        if self.shadow is not None:  # its recurrent layers apply the step's token once more
            self.shadow.applied[self.k] += 1


class _Event:
    def record(self, stream=None) -> None: ...

    def synchronize(self) -> None: ...


class _Shadow:
    """RecurrentShadow's calls, and what they do to each segment's recurrent state: the
    number of times the step's token was applied (a restore puts segments back to none)."""

    def __init__(self, log: list, n_segments: int) -> None:
        self.log, self.applied = log, [0] * n_segments

    def save(self, slots) -> None:
        self.log.append(("save", None))

    def restore(self, first: int, end: int) -> None:
        self.log.append(("restore", (first, end)))
        for k in range(first, end):
            self.applied[k] = 0


@pytest.mark.parametrize("hybrid", [False, True])
@pytest.mark.parametrize("run_ahead", [1, 2, 4, 50])
def test_replay_reruns_every_segment_after_a_missed_layer(run_ahead, hybrid, rng_seed):
    rng = random.Random(rng_seed)
    n_layers = rng.randint(3, 12)
    for _ in range(30):
        log: list = []
        missing = {j for j in range(n_layers) if rng.random() < 0.3}

        def resolve(layer, b, log=log, missing=missing):
            log.append(("resolve", layer))
            return layer in missing

        graphs = object.__new__(SegmentedDecodeGraphs)
        graphs.bank = SimpleNamespace(
            resolve=resolve,
            settle_fills=lambda log=log: log.append(("settle", None)),
            flush_hits=lambda log=log: log.append(("flush", None)),
        )
        graphs.model = SimpleNamespace(expert_bank=None)
        shadow = _Shadow(log, n_layers + 1) if hybrid else None
        graphs.segments = {1: [_Segment(i, log, shadow) for i in range(n_layers + 1)]}
        graphs.done = [_Event() for _ in range(n_layers + 1)]
        graphs.outputs = {1: torch.zeros(1, 2)}
        graphs.run_ahead, graphs.reruns, graphs.wait_s = run_ahead, 0, 0.0
        graphs.missed_layers = 0
        graphs.miss_rate = [rng.choice([0.0, 0.9]) for _ in range(n_layers)]
        graphs._load = lambda inputs: (1, 1)
        graphs._stream = lambda: None
        graphs.state_slots = torch.zeros(1, dtype=torch.long)
        graphs.shadow = shadow
        graphs.replay(None)
        if hybrid:  # saved before anything ran; every segment's token applied exactly once
            assert log.index(("save", None)) < [what for what, _ in log].index("run")
            assert shadow.applied == [1] * (n_layers + 1), log
        # The last step's fills behind are settled before any segment reads the table.
        assert [what for what, _ in log].index("settle") < [what for what, _ in log].index("run")
        # The hits' bookkeeping is flushed once, after the last resolve and the last launch.
        assert [what for what, _ in log].count("flush") == 1 and log[-1] == ("flush", None)
        log[:] = [entry for entry in log if entry[0] in ("run", "resolve")]
        last_run = {k: i for i, (what, k) in enumerate(log) if what == "run"}
        resolved = {k: i for i, (what, k) in enumerate(log) if what == "resolve"}
        assert sorted(resolved) == list(range(n_layers))  # each layer placed once
        assert [what for what, _ in log].count("resolve") == n_layers
        order = [last_run[k] for k in range(n_layers + 1)]
        assert order == sorted(order)  # the final runs of the segments go in order
        for j in range(n_layers):
            assert resolved[j] > last_run[j]  # decided on the routing of seg_j's final run
            if j in missing:  # the next segment ran after the misses were placed
                assert last_run[j + 1] > resolved[j]
        wasted = sum(1 for what, _ in log if what == "run") - (n_layers + 1)
        assert graphs.reruns == wasted
        assert graphs.missed_layers == len(missing)  # each layer with a miss: one stop
        if not missing:
            assert wasted == 0


def test_run_ahead_passes_only_layers_missing_less_than_the_gate(rng_seed):
    """The segment after layer j is queued before j's check exactly when j's running miss
    rate is below `miss_gate` (a benchmark sweeps the gate; segmented_graphs.MISS_GATE)."""
    rng = random.Random(rng_seed)
    for _ in range(20):
        n_layers, gate = rng.randint(2, 12), rng.uniform(0.05, 1.0)
        log: list = []

        def resolve(layer, b, log=log) -> bool:  # no layer misses
            log.append(("resolve", layer))
            return False

        graphs = object.__new__(SegmentedDecodeGraphs)
        graphs.bank = SimpleNamespace(
            resolve=resolve, settle_fills=lambda: None, flush_hits=lambda: None
        )
        graphs.model = SimpleNamespace(expert_bank=None)
        graphs.segments = {1: [_Segment(i, log) for i in range(n_layers + 1)]}
        graphs.done = [_Event() for _ in range(n_layers + 1)]
        graphs.outputs = {1: torch.zeros(1, 2)}
        graphs.run_ahead, graphs.reruns, graphs.wait_s, graphs.missed_layers = 50, 0, 0.0, 0
        graphs.miss_gate = gate
        rates = [rng.random() for _ in range(n_layers)]
        graphs.miss_rate = list(rates)
        graphs._load, graphs._stream = (lambda inputs: (1, 1)), (lambda: None)
        graphs.shadow = None
        graphs.replay(None)
        at = {entry: i for i, entry in enumerate(log)}
        for j in range(n_layers):
            ahead = at[("run", j + 1)] < at[("resolve", j)]
            assert ahead == (rates[j] < gate), (j, rates[j], gate)


@pytest.mark.parametrize("slots", [1, 9, 15])  # of 16 rows
def test_direct_graph_step_reads_misses_then_learns(tmp_path, rng_seed, slots):
    """Policy direct under a decode graph: each layer's captured half records the routing and
    computes every pair (misses read from the pool) with no host decision; `after_step`, run
    once the step is over, counts each layer's experts and fills misses into slots."""
    bank, spec, io = graph_bank(tmp_path, rng_seed, "direct", slots)
    e, k, h = spec.n_experts, spec.top_k, spec.hidden_size
    gen = torch.Generator().manual_seed(rng_seed)
    rng = random.Random(rng_seed)
    for _ in range(25):
        t = rng.randint(1, 4)
        distinct = 0
        experts_before = bank.stats.experts
        for layer in range(spec.n_moe_layers):
            hidden = torch.randn(t, h, generator=gen)
            ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).int()
            weights = torch.rand(t, k, generator=gen)
            want = fused_moe(hidden, bank.pool.w13, bank.pool.w2, ids + layer * e, weights)
            got = bank(layer, hidden, ids, weights)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            assert torch.equal(io.ids[layer, :t], ids)
            distinct += len(set(ids.flatten().tolist()))
        assert bank.stats.experts == experts_before  # nothing counted within the step
        bank.after_step(t)
        assert bank.stats.experts - experts_before == distinct  # every layer, once, after it
        bank.check_integrity()
    st = bank.stats
    assert st.direct == st.experts - st.hits > 0 and st.on_cpu == 0
    assert st.fetched > 0 or slots == 1


def test_fills_behind_reach_the_table_only_after_their_layer(tmp_path, rng_seed):
    """EngineConfig.fill_behind: a stop waits for q* of its misses' fills and runs the rest on
    the CPU while they are filled too. Those stay out of the device table (the CPU's part has
    them) until a later stop settles them; a segment that read the table before that, and is
    routed to them, runs again. Results stay the resident bank's throughout."""
    make_tiny("qwen3_moe", tmp_path, rng_seed, num_experts=16, num_experts_per_tok=4)
    engine = Engine.load(tmp_path, device="cpu", policy="adaptive", expert_slots=20,
                         fill_behind=True, progress=False)  # fmt: skip
    bank, spec = engine.loaded.bank, engine.spec
    io = bank.attach_graph_io(max_tokens=4, dtype=torch.float32)
    io.active = True
    bank.adaptive.verdict = lambda gain: "all"  # fills pay: every miss is filled
    e, k, h = spec.n_experts, spec.top_k, spec.hidden_size
    gen = torch.Generator().manual_seed(rng_seed)
    rng = random.Random(rng_seed)
    stale_reruns = 0
    in_flight: set[int] = set()
    for _ in range(60):
        layer = rng.randrange(spec.n_moe_layers)
        ids = torch.stack([torch.randperm(e, generator=gen)[:k]]).int()
        if in_flight and rng.random() < 0.5:  # routed to experts still filling behind
            lid = rng.choice(sorted(in_flight))
            layer, mine = lid // e, lid % e
            if mine not in ids[0].tolist():
                ids[0, 0] = mine
        routed = set((ids + layer * e).flatten().tolist())
        hidden = torch.randn(1, h, generator=gen)
        weights = torch.rand(1, k, generator=gen)
        want = fused_moe(hidden, bank.pool.w13, bank.pool.w2, ids + layer * e, weights)
        first = bank(layer, hidden, ids, weights)  # the speculative segment
        was_in_flight = routed & in_flight
        missed = bank.resolve(layer, 1)
        again = bank(layer, hidden, ids, weights)  # the segment after resolve
        torch.testing.assert_close(again, want, rtol=1e-5, atol=1e-5)
        if was_in_flight:
            assert missed, "a segment that read the table before the settle was accepted"
            stale_reruns += 1
        if not missed:
            assert torch.equal(first, again)
        in_flight = bank.cache.inflight.lids
        table = bank.cache.slot_of.tolist()
        assert all(table[lid] == -1 and bank.cache.resident(lid) for lid in in_flight)
        assert not io.cpu_part.any()
        bank.check_integrity()
    assert bank.stats.behind > 0 and stale_reruns > 0


@pytest.mark.parametrize("policy", ["transfer", "adaptive"])
def test_hit_fast_path_keeps_the_general_paths_state(policy, tmp_path, rng_seed):
    """`resolve`'s check for a layer whose experts are all in slots, its bookkeeping waiting
    for `flush_hits`, must leave the bank as the general path does: the same answers, and once
    flushed the same LRU order, fill races and counts; a layer that misses meanwhile must
    choose its victims as the general path would. Two banks resolve the same routing (fresh
    draws, some repeating cached experts so layers hit), one with the fast path turned off."""
    banks = []
    for fast in (True, False):
        bank, spec, _ = graph_bank(tmp_path / str(fast), rng_seed, policy, slots=9)
        if not fast:
            bank._hit = lambda lids: False
        banks.append(bank)
    e, k, h = spec.n_experts, spec.top_k, spec.hidden_size
    gen = torch.Generator().manual_seed(rng_seed)
    rng = random.Random(rng_seed)
    hits = 0
    for _ in range(60):
        layer, t = rng.randrange(spec.n_moe_layers), rng.randint(1, 3)
        resident = [x for x in range(e) if banks[0].cache.resident(layer * e + x)]
        if len(resident) >= k and rng.random() < 0.5:
            ids = torch.tensor([rng.sample(resident, k) for _ in range(t)]).int()
        else:
            ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).int()
        hidden = torch.randn(t, h, generator=gen)
        weights = torch.rand(t, k, generator=gen)
        answers = []
        for bank in banks:
            bank(layer, hidden, ids, weights)
            answers.append(bank.resolve(layer, t))
            bank(layer, hidden, ids, weights)
        assert answers[0] == answers[1]
        hits += not answers[0]
        # Hits' bookkeeping waits: flushed here at random, else by the next layer that misses
        # (before its victims are chosen) or at the end.
        if rng.random() < 0.5:
            banks[0].flush_hits()
            _assert_same_cache_state(*banks)
    banks[0].flush_hits()
    _assert_same_cache_state(*banks)
    assert hits > 0  # the fast path ran
    for bank in banks:
        bank.check_integrity()


def _assert_same_cache_state(fast_bank, slow_bank) -> None:
    fast, slow = fast_bank.cache, slow_bank.cache
    assert list(fast._lru) == list(slow._lru)
    assert fast.host_slot_of == slow.host_slot_of
    assert fast.races.pending == slow.races.pending
    assert fast.fill_gain == slow.fill_gain
    assert (fast.hits, fast.misses) == (slow.hits, slow.misses)
    assert fast_bank.stats == slow_bank.stats
