"""Finished requests' latency histograms and finish reasons (engine/request_metrics.py): the
buckets hold what was observed, and an engine observes every request that ends, once, with the
figures its own output reports."""

from __future__ import annotations

import random

import numpy as np
import pytest
from tiny_models import make_tiny

from freetoken_agent import Engine, SamplingParams
from freetoken_agent.engine.request_metrics import Histogram


def test_a_histogram_counts_each_value_in_the_bucket_of_its_bound(rng_seed):
    rng = np.random.default_rng(rng_seed)
    bounds = tuple(np.unique(np.round(rng.uniform(0, 10, size=rng.integers(3, 12)), 2)))
    values = rng.uniform(-1, 12, size=rng.integers(50, 400))
    values[: len(bounds)] = bounds  # a value on a bound falls in that bound's bucket (le)
    h = Histogram(bounds)
    for v in values:
        h.observe(float(v))
    expected = np.bincount(np.searchsorted(bounds, values, side="left"), minlength=len(bounds) + 1)
    assert h.counts == expected.tolist()
    assert h.count == len(values) and h.total == pytest.approx(values.sum())
    assert h.to_json()["counts"] == h.counts


@pytest.mark.parametrize("bounds", [(1.0, 1.0), (2.0, 1.0)])
def test_bounds_must_increase(bounds):
    with pytest.raises(ValueError, match="increase strictly"):
        Histogram(bounds)


@pytest.mark.parametrize("overlap", [False, True])
def test_every_ended_request_is_observed_once_with_its_own_figures(tmp_path, rng_seed, overlap):
    rng = random.Random(rng_seed)
    make_tiny("qwen3_moe", tmp_path, rng_seed)
    # Two sequences at a time: the rest wait, and one is aborted while still waiting.
    engine = Engine.load(tmp_path, device="cpu", progress=False, max_num_seqs=2,
                         overlap_schedule=overlap)  # fmt: skip
    n = rng.randint(4, 7)
    ids = []
    for _ in range(n):
        prompt = [rng.randrange(3, 320) for _ in range(rng.randint(1, 40))]
        sp = SamplingParams(max_tokens=rng.randint(1, 9), temperature=rng.choice([0, 0.7]),
                            ignore_eos=True, seed=rng.randrange(1 << 30))  # fmt: skip
        ids.append(engine.submit(prompt, sp))
    waiting = ids[-1]
    engine.abort(waiting)
    steps = 0
    running_abort = None
    while engine.has_unfinished():
        engine.step()
        steps += 1
        if steps == 2 and running_abort is None:
            started = [r for r in ids[:-1] if engine._requests[r].output_ids
                       and engine._requests[r].finish_reason is None]  # fmt: skip
            if started:
                running_abort = started[0]
                engine.abort(running_abort)
    outs = [engine._collect(r) for r in ids]
    latency = engine.stats()["latency"]

    reasons: dict[str, int] = {}
    for o in outs:
        reasons[o.finish_reason] = reasons.get(o.finish_reason, 0) + 1
    assert latency["finish_reasons"] == reasons
    assert reasons["abort"] == 1 + (running_abort is not None)
    assert latency["request_prompt_tokens"]["count"] == n
    assert latency["request_prompt_tokens"]["sum"] == sum(len(o.prompt_ids) for o in outs)
    assert latency["request_generation_tokens"]["sum"] == sum(len(o.token_ids) for o in outs)
    with_tokens = [o for o in outs if o.token_ids]
    ttft = latency["time_to_first_token_seconds"]
    assert ttft["count"] == len(with_tokens)
    assert ttft["sum"] == pytest.approx(sum(o.stats["ttft_s"] for o in with_tokens))
    assert latency["time_per_output_token_seconds"]["count"] == sum(
        len(o.token_ids) > 1 for o in outs
    )
    e2e = latency["e2e_request_latency_seconds"]
    assert e2e["count"] == n
    assert e2e["sum"] == pytest.approx(sum(o.stats["total_s"] for o in outs))
    # Every request but the one aborted while waiting was admitted: its queue time ended.
    queue = latency["queue_seconds"]
    assert queue["count"] == n - 1
    assert 0 <= queue["sum"] <= e2e["sum"]
    for figures in latency.values():
        if isinstance(figures, dict) and "counts" in figures:
            assert sum(figures["counts"]) == figures["count"]
