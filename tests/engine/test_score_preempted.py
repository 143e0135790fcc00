"""`Engine.score` beside running requests: when the KV pool is full its request is preempted
and computes again from the start; the rows it had kept were kept twice (a 100-token score
came back with 725 rows). Its rows are now those of each position once."""

from __future__ import annotations

import random

import torch

from freetoken_agent import Engine, SamplingParams
from freetoken_agent.demo_model import ensure_demo_model


def test_a_preempted_score_keeps_each_row_once(tmp_path, rng_seed):
    rng = random.Random(rng_seed)
    path = ensure_demo_model(tmp_path)
    n = rng.randint(90, 120)
    ids = [rng.randrange(3, 1000) for _ in range(n)]
    want = Engine.load(path, device="cpu", progress=False).score(ids)
    engine = Engine.load(path, device="cpu", progress=False, kv_tokens=192,
                         max_batched_tokens=16, overlap_schedule=False)  # fmt: skip
    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    for _ in range(2):  # two running requests that fill the pool as they decode
        engine.submit([rng.randrange(3, 1000) for _ in range(60)], sp)
    for _ in range(rng.randint(2, 4)):
        engine.step()
    before = engine.scheduler.preemptions
    got = engine.score(ids)
    assert engine.scheduler.preemptions > before  # the score request was preempted
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_rows_kept_from_a_restart_position_replace_the_old_ones(rng_seed):
    """`keep_rows` at random chunk cuts and a restart at a random position (mid-chunk too):
    the kept rows are each position's latest, once, in order."""
    from freetoken_agent.engine.request_outcomes import keep_rows

    rng = random.Random(rng_seed)
    n = rng.randint(5, 60)
    rows = torch.randn(n, 3)
    kept, done = [], 0
    while done < n:  # a first pass, cut short
        step = rng.randint(1, 9)
        keep_rows(kept, done, rows[done : done + step] + 100)  # values to be replaced
        done = min(n, done + step)
    restart = rng.randint(0, n - 1)
    done = restart
    while done < n:  # computed again from `restart`
        step = rng.randint(1, 9)
        keep_rows(kept, done, rows[done : done + step])
        done = min(n, done + step)
    want = torch.cat([rows[:restart] + 100, rows[restart:]])
    assert torch.equal(torch.cat(kept), want)
