"""Token log-probabilities (engine/token_logprobs.py) on the CPU: what a request with
SamplingParams.logprobs gets is the model's raw distribution at each generated token, checked
against transformers' own forward of prompt + output; asking changes no token and no other
request's events; a step where nobody asks does no logprob work at all."""

from __future__ import annotations

import random

import pytest
import torch
from logprob_checks import (
    check_against_reference,
    event_rows,
    mixed_batch,
    reference_logprobs,
    run_batch,
    without_logprobs,
)
from tiny_models import make_tiny

from freetoken_agent import Engine, SamplingParams
from freetoken_agent.engine.token_logprobs import HostStaging, StepLogprobs


def _load(path, overlap: bool) -> Engine:
    return Engine.load(path, device="cpu", progress=False, kv_tokens=4096, overlap_schedule=overlap)


@pytest.fixture
def tiny(tmp_path, rng_seed):
    return make_tiny("qwen3_moe", tmp_path, rng_seed), tmp_path


@pytest.mark.parametrize("overlap", [False, True])
def test_reported_logprobs_are_the_models_raw_distribution(tiny, rng_seed, overlap):
    hf, path = tiny
    rng = random.Random(rng_seed)
    batch = mixed_batch(rng)
    engine = _load(path, overlap)
    outs, events = run_batch(engine, batch)
    if overlap:
        assert engine.overlap.lagged_steps >= 3, rng_seed
    plain_outs, plain_events = run_batch(_load(path, overlap), without_logprobs(batch))
    for (prompt, sp), out, evs, plain, plain_evs in zip(
        batch, outs, events, plain_outs, plain_events, strict=True
    ):
        # Asking changes nothing else: the same tokens, texts and ends, whoever asked.
        assert out.token_ids == plain.token_ids, rng_seed
        assert event_rows(evs) == event_rows(plain_evs), rng_seed
        assert plain.logprobs is None and all(e.logprob is None for e in plain_evs)
        if sp.logprobs is None:
            assert out.logprobs is None, rng_seed
            assert all(e.logprob is None and e.top_logprobs is None for e in evs), rng_seed
            continue
        # Every token's event carries the output's entry for it; the final event too.
        carried = [e.token_logprob() for e in evs if e.token_id is not None]
        assert carried == out.logprobs, rng_seed
        ref = reference_logprobs(hf, prompt, out.token_ids)
        check_against_reference(out, sp.logprobs, ref, 2e-5, rng_seed)


def test_stream_and_generate_carry_them(tiny, rng_seed):
    """Engine.stream's events and Engine.generate's output, alone: the same entries."""
    hf, path = tiny
    rng = random.Random(rng_seed)
    prompt = [rng.randrange(3, 320) for _ in range(rng.randint(3, 30))]
    k = rng.randint(0, 20)
    sp = SamplingParams(max_tokens=rng.randint(3, 12), temperature=0, ignore_eos=True, logprobs=k)
    overlap = rng.random() < 0.5
    out = _load(path, overlap).generate(prompt, sp)
    # A fresh engine: a second request would reuse the first's KV, computed in other shapes.
    events = _load(path, overlap).stream(prompt, sp)
    streamed = [e.token_logprob() for e in events if e.token_id is not None]
    assert streamed == out.logprobs, rng_seed
    check_against_reference(out, k, reference_logprobs(hf, prompt, out.token_ids), 2e-5, rng_seed)


@pytest.mark.parametrize("overlap", [False, True])
def test_no_work_when_nobody_asks(tiny, rng_seed, overlap, monkeypatch):
    """Greedy and sampled steps where no row asks: no log_softmax, no topk of the vocabulary,
    nothing attached to the sampled tokens, no staging buffers."""
    _, path = tiny
    rng = random.Random(rng_seed)
    engine = _load(path, overlap)

    def refuse(*args, **kwargs):
        raise AssertionError("log_softmax ran in a step where nobody asked for logprobs")

    monkeypatch.setattr(torch, "log_softmax", refuse)
    sample_tokens = engine.runner.sample_tokens
    attached = []

    def watched(*args, **kwargs):
        reqs, sampled = sample_tokens(*args, **kwargs)
        attached.append(None if sampled is None else sampled.logprobs)
        return reqs, sampled

    monkeypatch.setattr(engine.runner, "sample_tokens", watched)
    sps = [
        SamplingParams(max_tokens=rng.randint(4, 10), temperature=t, ignore_eos=True, seed=i)
        for i, t in enumerate([0.0, 0.9])
    ]
    outs = engine.generate([[rng.randrange(3, 320) for _ in range(9)] for _ in sps], sps)
    assert all(o.logprobs is None for o in outs)
    assert attached and all(a is None for a in attached)
    assert engine.overlap._logprobs._sets == [None, None]


def test_host_staging_copies_into_alternating_buffers(rng_seed, monkeypatch):
    """The overlapped loop's staging (on CUDA: pinned buffers, copied behind the step's event),
    its buffer logic on the CPU: what it returns is a copy of the step's values, not a view of
    them, in the slot's own buffers (poisoned: an unwritten entry shows), and a slot is not
    overwritten by the other's step."""
    gen = torch.Generator().manual_seed(rng_seed)
    empty = torch.empty

    def unpinned_poisoned(*shape, dtype, pin_memory=False):
        t = empty(*shape, dtype=dtype)
        return t.fill_(float("nan") if t.is_floating_point() else -(2**31))

    monkeypatch.setattr(torch, "empty", unpinned_poisoned)
    staging = HostStaging(8, pinned=True)
    steps, staged = [], []
    for slot in (0, 1):
        r, k = (
            int(torch.randint(1, 9, (), generator=gen)),
            int(torch.randint(1, 21, (), generator=gen)),
        )
        values = torch.randn(r, k, generator=gen, dtype=torch.float64).sort(-1, True).values
        step = StepLogprobs(
            sorted(torch.randperm(8, generator=gen)[:r].tolist()),
            [k] * r,
            torch.randn(r, generator=gen, dtype=torch.float64),
            values,
            torch.randint(0, 1000, (r, k), generator=gen),
        )
        steps.append(step)
        staged.append(staging.stage(step, slot))
    assert staging.stage(None, 0) is None
    for step, host in zip(steps, staged, strict=True):
        assert host.rows == step.rows and host.ks == step.ks
        torch.testing.assert_close(host.chosen, step.chosen.float(), rtol=0, atol=0)
        torch.testing.assert_close(host.top_values, step.top_values.float(), rtol=0, atol=0)
        assert torch.equal(host.top_ids, step.top_ids)
        step.chosen.fill_(7.0)  # the source changing later (the device's next step) is not seen
        assert not (host.chosen == 7.0).any(), rng_seed
