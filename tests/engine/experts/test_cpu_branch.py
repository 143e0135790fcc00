"""The CPU branch's online B_H (engine/experts/cpu_branch.py): a run counts each expert's
weights once per `cpu_cost` read, as q* prices it, so runs past the knee (a prompt chunk's)
observe the same bandwidth as decode's one-token runs instead of dragging B_H down."""

import random
import types

import pytest
import torch

from freetoken_agent.engine.experts import calibration, cpu_branch
from freetoken_agent.engine.experts.policy import Bandwidths
from freetoken_agent.engine.experts.pool import ExpertPool

N, H, W, K = 16, 8, 4, 4  # pool rows, hidden, expert width, choices a token


def _routing(rng: random.Random, tokens: int, hot: int, hot_tokens: int) -> torch.Tensor:
    """[T, K] distinct experts a token; `hot` among the first `hot_tokens` tokens' choices."""
    rows = []
    for t in range(tokens):
        others = rng.sample([e for e in range(N) if e != hot], K)
        if t < hot_tokens:
            others[rng.randrange(K)] = hot
        rows.append(others)
    return torch.tensor(rows, dtype=torch.int64)


@pytest.mark.parametrize("tokens", [3, 40])  # the set lookup (<= 64 pairs), then numpy's
def test_a_timed_run_counts_reads_past_the_knee(rng_seed, monkeypatch, tokens):
    rng = random.Random(rng_seed)
    g = torch.Generator().manual_seed(rng_seed)
    pool = ExpertPool(torch.randn(N, 2 * W, H, generator=g), torch.randn(N, H, W, generator=g))
    knee = rng.uniform(1.5, 2.5)
    hot = rng.randrange(N)
    lids = _routing(rng, tokens, hot, hot_tokens=min(tokens, rng.randint(3, 8)))
    present = sorted(set(lids.reshape(-1).tolist()) - {hot})
    on_cpu = [hot] + rng.sample(present, rng.randint(0, len(present)))
    seconds = rng.uniform(1e-4, 1e-2)
    clock = iter([0.0, seconds])
    monkeypatch.setattr(cpu_branch, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    bandwidths = Bandwidths(pcie=rng.uniform(10e9, 60e9), cpu=rng.uniform(10e9, 90e9), knee=knee)
    before = bandwidths.cpu
    hidden = torch.randn(tokens, H, generator=g)
    weights = torch.rand(tokens, K, generator=g)

    source = rng.choice(["decode", "prompt"])
    part = cpu_branch.run_on_cpu(pool, bandwidths, hidden, lids, weights, on_cpu, timed=True,
                                 source=source)  # fmt: skip

    served = [int((lids == lid).sum()) for lid in on_cpu]
    reads = sum(max(1.0, t / knee) for t in served)
    assert max(served) > knee  # the hot expert is past the knee: bytes alone would differ
    want = calibration.update(before, reads * pool.expert_bytes, seconds)
    assert bandwidths.cpu == pytest.approx(want, rel=1e-9)
    # The observation, kept for diagnosis under its source.
    assert len(bandwidths.cpu_seen) == 1
    seen_source, seen_bytes, seen_seconds = bandwidths.cpu_seen[0]
    assert seen_source == source and seen_seconds == seconds
    assert seen_bytes == pytest.approx(reads * pool.expert_bytes, rel=1e-9)
    # The run itself: the CPU pairs of a plain SwiGLU over the pool, the rest left out.
    ref = torch.zeros(tokens, H)
    for t in range(tokens):
        for k in range(K):
            lid = int(lids[t, k])
            if lid in on_cpu:
                gate, up = (pool.w13[lid] @ hidden[t]).chunk(2)
                ref[t] += weights[t, k] * (pool.w2[lid] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(part.float(), ref, rtol=1e-4, atol=1e-4)


def test_an_untimed_run_leaves_the_estimate(rng_seed):
    rng = random.Random(rng_seed)
    pool = ExpertPool(torch.randn(N, 2 * W, H), torch.randn(N, H, W))
    lids = _routing(rng, 5, rng.randrange(N), hot_tokens=5)
    bandwidths = Bandwidths(cpu=rng.uniform(10e9, 90e9))
    before = bandwidths.cpu
    cpu_branch.run_on_cpu(pool, bandwidths, torch.randn(5, H), lids, torch.rand(5, K),
                          sorted(set(lids.reshape(-1).tolist())), timed=False)  # fmt: skip
    assert bandwidths.cpu == before and not bandwidths.cpu_seen
