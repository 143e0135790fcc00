"""The physical limits beside the bench figures (DESIGN section 7)."""

from __future__ import annotations

import functools
import math
import random
import sys

from tiny_models import make_tiny

from freetoken_agent import Engine
from freetoken_agent.bench import limits
from freetoken_agent.bench.elastic_rows import Limits
from freetoken_agent.bench.limits import host_paths, host_paths_bandwidth, host_read_bandwidth
from freetoken_agent.engine.snapshot_rows import MIN_KEPT


def test_the_two_host_paths_are_capped_by_host_memory(rng_seed):
    rng = random.Random(rng_seed)
    for _ in range(100):
        b_p, b_h, b_read = (rng.uniform(1e9, 150e9) for _ in range(3))
        both = host_paths(b_p, b_h, b_read)
        assert both == min(b_p + b_h, b_read)
        assert both <= b_read and both <= b_p + b_h


def test_host_read_bandwidth_measures_a_plausible_rate():
    rate = host_read_bandwidth(gib=0.05, repeats=3)
    assert math.isfinite(rate) and 1e8 < rate < 5e12


def test_both_host_paths_are_measured_reading_at_once(rng_seed):
    """The link's copies and the CPU kernel's experts, both counted, over the window they ran
    together (on the CPU the link is a memcpy into a host buffer)."""
    import torch

    gen = torch.Generator().manual_seed(rng_seed)
    n, hidden, inter = 12, 64, 32
    w13 = torch.randn(n, 2 * inter, hidden, generator=gen).to(torch.bfloat16)
    w2 = torch.randn(n, hidden, inter, generator=gen).to(torch.bfloat16)
    rates = host_paths_bandwidth(w13, w2, torch.device("cpu"), seconds=0.2)
    assert rates["link_gb_s"] > 0 and rates["cpu_gb_s"] > 0
    assert math.isclose(rates["both_gb_s"], rates["link_gb_s"] + rates["cpu_gb_s"])
    assert rates["both_gb_s"] < 5e3


def test_the_decode_limit_uses_the_capped_host_paths(tmp_path, rng_seed):
    """A turn's decode limit: resident bytes at B_HBM plus miss bytes at the capped host
    paths; lowering the host read bandwidth below B_P + B_H lowers the limit accordingly."""
    rng = random.Random(rng_seed)
    make_tiny("qwen3_moe", tmp_path, rng_seed)
    engine = Engine.load(tmp_path, device="cpu", policy="transfer", expert_slots=4,
                         progress=False)  # fmt: skip
    limits = Limits({}, on_gpu=False)
    limits.on_gpu = True  # bandwidths as a device run would have measured them
    limits.hbm, limits.pcie, limits.cpu = 4e12, 50e9, 70e9
    miss_rate, context = rng.uniform(0.1, 0.9), rng.randrange(100, 1000)

    def limit(host_read: float) -> float:
        limits.host_read = host_read
        row = {"miss_rate": miss_rate, "experts_per_token": 32.0, "prefilled_tokens": 100}
        limits.add(row, engine, context=context, chunk=512)
        return row["decode_limit_tok_s"]

    uncapped = limit(1e15)  # uncapped: B_P + B_H
    capped = limit(60e9)  # half of B_P + B_H
    moved = 32.0 * engine.loaded.bank.pool.expert_bytes * miss_rate
    extra = moved / 60e9 - moved / 120e9
    assert capped < uncapped
    assert math.isclose(1 / capped - 1 / uncapped, extra, rel_tol=1e-9)


def test_offload_limits_use_the_best_caps_any_probe_saw(rng_seed):
    """bench offload's limits: each cap is the best of the run's probes (a slow moment of the
    host never lowers a limit), and a row's limit is batch / (device bytes / B_HBM + host
    bytes / the caps' miss bandwidth), both host paths under the read cap whichever policy
    ran (a row without a CPU branch, whole_step, gets the machine's limit too)."""
    from freetoken_agent.bench.host_caps import HostCaps, above_limits

    rng = random.Random(rng_seed)
    probes = [tuple(rng.uniform(10e9, 150e9) for _ in range(3)) for _ in range(rng.randint(2, 6))]
    caps = HostCaps(*probes[0])
    for i, probe in enumerate(probes[1:]):
        caps.observe(f"probe {i}", *probe)
    best_p, best_h, best_read = (max(p[j] for p in probes) for j in range(3))
    assert (caps.b_p, caps.b_h, caps.b_read) == (best_p, best_h, best_read)
    assert len(caps.probes) == len(probes) - 1
    b_hbm = rng.uniform(1e12, 5e12)
    for whole in (False, True):
        dense, hits = rng.uniform(1e9, 3e9), rng.uniform(0, 3e9)
        row = {"tok_s": rng.uniform(10, 500), "batch": rng.choice((1, 4)), "whole_step": whole,
               "step_device_bytes": dense + hits, "step_hit_bytes": hits,
               "step_host_bytes": rng.uniform(0, 2e9)}  # fmt: skip
        caps.bound(row, b_hbm)
        link = min(best_p + best_h, best_read)
        floor = row["step_device_bytes"] / b_hbm + row["step_host_bytes"] / link
        assert math.isclose(row["limit_tok_s"], row["batch"] / floor)
        assert math.isclose(row["of_limit"], row["tok_s"] / row["limit_tok_s"])
        # With the hits read beside the misses: only the longer of the two counts.
        overlapped = dense / b_hbm + max(hits / b_hbm, row["step_host_bytes"] / link)
        assert math.isclose(row["limit_overlap_tok_s"], row["batch"] / overlapped)
        assert math.isclose(row["of_overlap_limit"], row["tok_s"] / row["limit_overlap_tok_s"])
        assert row["limit_overlap_tok_s"] >= row["limit_tok_s"]
        before = row["limit_tok_s"]
        caps.observe("slower", best_p / 2, best_h / 2, best_read / 2)
        caps.bound(row, b_hbm)
        assert row["limit_tok_s"] == before
    # A row faster than its limit is named (a cap probed below its best), the others are not.
    rows = {"fast": {"tok_s": 60.0, "limit_tok_s": 45.0, "of_limit": 60 / 45},
            "slow": {"tok_s": 40.0, "limit_tok_s": 45.0, "of_limit": 40 / 45}}  # fmt: skip
    lines = above_limits(rows)
    assert len(lines) == 1 and "fast" in lines[0] and "60.0" in lines[0]


def test_an_offload_probe_measures_the_runs_own_pool(rng_seed):
    """A probe reads the run's pool with both miss paths (on the CPU the link is a memcpy) and
    the CPU kernel alone; each is recorded and raises the caps."""
    import torch

    from freetoken_agent.bench.host_caps import HostCaps

    gen = torch.Generator().manual_seed(rng_seed)
    n, hidden, inter = 16, 64, 32
    w13 = torch.randn(n, 2 * inter, hidden, generator=gen).to(torch.bfloat16)
    w2 = torch.randn(n, hidden, inter, generator=gen).to(torch.bfloat16)
    caps = HostCaps()
    both = caps.probe("start", w13, w2, torch.device("cpu"))
    assert both["both_gb_s"] > 0
    assert caps.b_read == 1e9 * both["both_gb_s"] and caps.b_h > 0
    assert [p["when"] for p in caps.probes] == ["start"]
    assert caps.probes[0]["b_h_gb_s"] == caps.b_h / 1e9
    if sys.platform.startswith("linux"):  # the cores' use before and during it (cpu_load.py)
        idle, during = caps.probes[0]["idle_load"], caps.probes[0]["probe_load"]
        assert idle["seconds"] >= 0.5 and during["process_cores"] > 0.1, caps.probes[0]


def test_a_hybrid_models_kv_bytes_count_its_attention_layers_only(tmp_path, rng_seed):
    """The KV a decode step reads per held token: K and V in each attention layer; a hybrid
    model's recurrent layers have none (their limit once counted every layer's)."""
    import torch

    from freetoken_agent.bench.decode_baseline import kv_bytes_per_token

    make_tiny("qwen3_next", tmp_path, rng_seed)
    engine = Engine.load(tmp_path, device="cpu", policy="resident", progress=False)
    spec = engine.spec
    attention = len(spec.attention_layers)
    assert 0 < attention < spec.n_layers, "the tiny hybrid has both kinds of layer"
    itemsize = torch.tensor([], dtype=engine.loaded.dtype).element_size()
    assert kv_bytes_per_token(engine) == 2 * attention * spec.n_kv_heads * spec.head_dim * itemsize
    kv = engine.loaded.kv  # the pool itself: one K and one V slice per attention layer
    assert kv_bytes_per_token(engine) * kv.k.shape[1] * kv.page_size == kv.k.nbytes + kv.v.nbytes


def _fewest_streamed(tokens: int, chunk: int, stream_min: int, cuts: bool) -> int:
    """By search: the fewest chunks of stream_min tokens or more over every way the scheduler
    may cut `tokens`: a chunk planned at n = min(left, chunk) tokens ends at n, or, with
    `cuts` (snapshot_rows.chunk_length, at a checkpoint's boundary), at any length from
    ceil(MIN_KEPT * n)."""

    @functools.cache
    def fewest(left: int) -> int:
        if left == 0:
            return 0
        n = min(left, chunk)
        low = math.ceil(MIN_KEPT * n) if cuts else n
        return min(int(size >= stream_min) + fewest(left - size) for size in range(low, n + 1))

    return fewest(tokens)


def test_streamed_chunks_is_the_fewest_any_cut_streams(rng_seed):
    """A chunk streams every layer whatever its length, so a re-prefill's link floor counts
    chunks, not tokens (bench elastic and agent divided tokens by a rate: a 300-token re-prefill
    was rated at a twentieth of its one chunk's time). The count is the fewest over every cut
    the scheduler may make, with and without checkpoints that end chunks early."""
    rng = random.Random(rng_seed)
    for _ in range(80):
        chunk = rng.randint(4, 40)
        stream_min = rng.randint(1, 2 * chunk)
        tokens = rng.randint(0, 5 * chunk)
        cuts = rng.random() < 0.5
        n = limits.streamed_chunks(tokens, chunk, stream_min, cuts)
        assert n == _fewest_streamed(tokens, chunk, stream_min, cuts), (
            tokens, chunk, stream_min, cuts)  # fmt: skip
        b_p, chunk_bytes = rng.uniform(10, 60) * 1e9, rng.uniform(1, 50) * 1e9
        floor = limits.streamed_prefill_floor_s(tokens, chunk, stream_min, cuts, chunk_bytes, b_p)
        assert floor == (n * chunk_bytes / b_p if n else None), (tokens, chunk, stream_min)
    # The review's case: 8,192 + 600 tokens on a hybrid may end 8,192 + 450 + 150: one streams.
    assert limits.streamed_chunks(8792, 8192, 512, cuts=True) == 1
    assert limits.streamed_chunks(8792, 8192, 512, cuts=False) == 2


def test_elastic_ttft_limit_streams_the_experts_no_slot_can_hold(tmp_path, rng_seed):
    """bench elastic's TTFT limit: per streamed chunk, the pool less what every slot the run
    had can hold, at B_P (it was prefilled tokens x the whole pool / chunk, which a re-prefill
    beat: a bound must not be beaten). A prefill too short to stream has none."""
    rng = random.Random(rng_seed)
    make_tiny("qwen3_moe", tmp_path, rng_seed)
    slots = rng.randint(1, 12)
    engine = Engine.load(tmp_path, device="cpu", policy="transfer", expert_slots=slots,
                         progress=False)  # fmt: skip
    bank = engine.loaded.bank
    rows = Limits({}, on_gpu=False)
    rows.on_gpu = True
    rows.hbm, rows.pcie, rows.cpu, rows.host_read = 4e12, rng.uniform(10, 60) * 1e9, 70e9, 1e11
    chunk = rng.choice([512, 1024, 2048])  # (no recurrent layers: whole chunks stream)
    for tokens in (rng.randint(1, bank.stream_min_tokens - 1), rng.randint(512, 5 * chunk)):
        row = {"miss_rate": 0.5, "experts_per_token": 8.0, "prefilled_tokens": tokens}
        rows.add(row, engine, context=tokens, chunk=chunk)
        n = limits.streamed_chunks(tokens, chunk, bank.stream_min_tokens, cuts=False)
        moved = bank.pool.nbytes - bank.cache.n_slots * bank.pool.expert_bytes
        expected = n * moved / rows.pcie if n else None
        assert row["ttft_limit_s"] == expected, (tokens, chunk, slots)
    assert n >= 1 and row["ttft_limit_s"] > 0
