"""The physical limits beside the bench figures (DESIGN section 7)."""

from __future__ import annotations

import math
import random

from tiny_models import make_tiny

from freetoken_agent import Engine
from freetoken_agent.bench.elastic_rows import Limits
from freetoken_agent.bench.limits import host_paths, host_paths_bandwidth, host_read_bandwidth


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
