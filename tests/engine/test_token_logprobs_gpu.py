"""Token log-probabilities on CUDA (device machine): decode steps replayed from captured graphs,
with and without overlap scheduling (whose logprobs reach the host through pinned buffers
copied behind the step's event, never a wait at sample time). What each request reports is
held to transformers' forward of its prompt + output, and asking changes no token or event.

fp32: the fp32 kernels keep their dots in IEEE fp32, but CUDA and the CPU still sum in other
orders; test_gpu.py's fp32 parity allows 5e-3 of the largest logit, so each logprob (a logit
minus a logsumexp) may be off by twice that."""

from __future__ import annotations

import random
import time

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

from freetoken_agent import Engine
from freetoken_agent.engine.cuda_graphs import DecodeGraphs

pytestmark = pytest.mark.gpu

CUDA = dict(device="cuda", progress=False, max_model_len=512, max_num_seqs=8, policy="resident")


def _engine(path, overlap: bool, monkeypatch) -> tuple[Engine, list[int]]:
    """An engine with decode graphs, and a list its graph replays are counted in."""
    engine = Engine.load(path, overlap_schedule=overlap, **CUDA)
    assert isinstance(engine.runner.graphs, DecodeGraphs), engine.graph_error
    replays: list[int] = []
    replay = engine.runner.graphs.replay

    def counted(*args, **kwargs):
        replays.append(1)
        return replay(*args, **kwargs)

    monkeypatch.setattr(engine.runner.graphs, "replay", counted)
    return engine, replays


@pytest.mark.parametrize("overlap", [True, False])
def test_logprobs_with_graph_decode(tmp_path, rng_seed, overlap, monkeypatch):
    hf = make_tiny("qwen3_moe", tmp_path, rng_seed)  # fp32, on the CPU: the reference
    rng = random.Random(rng_seed)
    batch = mixed_batch(rng, n=6)
    engine, replays = _engine(tmp_path, overlap, monkeypatch)
    outs, events = run_batch(engine, batch)
    assert len(replays) >= 5, (rng_seed, len(replays))  # decode ran from the graphs
    if overlap:
        assert engine.overlap.lagged_steps >= 3, rng_seed
        # Staged through pinned buffers, unless every request that asked ended before decode
        # overlapped (a stop id at once: rare).
        lengths = [len(o.token_ids) for (_, sp), o in zip(batch, outs, strict=True)
                   if sp.logprobs is not None]  # fmt: skip
        if any(n >= 4 for n in lengths):
            sets = [s for s in engine.overlap._logprobs._sets if s is not None]
            assert sets and all(t.is_pinned() for s in sets for t in s), (rng_seed, lengths)
    plain_engine, _ = _engine(tmp_path, overlap, monkeypatch)
    plain_outs, plain_events = run_batch(plain_engine, without_logprobs(batch))
    worst = 0.0
    for (prompt, sp), out, evs, plain, plain_evs in zip(
        batch, outs, events, plain_outs, plain_events, strict=True
    ):
        assert out.token_ids == plain.token_ids, rng_seed
        assert event_rows(evs) == event_rows(plain_evs), rng_seed
        if sp.logprobs is None:
            assert out.logprobs is None and all(e.logprob is None for e in evs), rng_seed
            continue
        assert [e.token_logprob() for e in evs if e.token_id is not None] == out.logprobs
        ref = reference_logprobs(hf, prompt, out.token_ids)
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out.token_ids])).logits[0]
        tol = 1e-2 * logits.abs().max().item()
        errs = [abs(e.logprob - ref[i, t].item()) for i, (t, e) in
                enumerate(zip(out.token_ids, out.logprobs, strict=True))]  # fmt: skip
        worst = max(worst, *errs)
        check_against_reference(out, sp.logprobs, ref, tol, rng_seed)
    print(f"overlap={overlap}: largest |logprob - transformers'| {worst:.2e}")


def test_staging_never_waits_for_the_device(rng_seed):
    """HostStaging's copies are queued, not waited for: behind a ~0.1 s device sleep, `stage`
    returns at once for every k (a strided pinned destination, a [:r, :k] slice of an [n, 20]
    buffer, was copied through an unpinned temporary: a copy that waits for the device), and
    once the event has completed the staged values are the device's."""
    from freetoken_agent.engine.token_logprobs import HostStaging, StepLogprobs

    rng = random.Random(rng_seed)
    n = 8
    staging = HostStaging(n, pinned=True)
    for k in (0, rng.randint(1, 19), 20):
        r = rng.randint(2, n)
        chosen = torch.randn(r, device="cuda")
        values = torch.randn(r, k, device="cuda") if k else None
        ids = torch.randint(0, 1000, (r, k), device="cuda") if k else None
        step = StepLogprobs(list(range(r)), [k] * r, chosen, values, ids)
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # ~0.1 s of device time queued ahead of the copies
        start = torch.cuda.Event(enable_timing=False)
        start.record()
        t0 = time.perf_counter()
        staged = staging.stage(step, rng.randint(0, 1))
        waited = time.perf_counter() - t0
        assert not start.query() and waited < 0.05, (k, waited, rng_seed)
        torch.cuda.synchronize()
        assert torch.equal(staged.chosen, chosen.cpu()), k
        if k:
            assert torch.equal(staged.top_values, values.cpu()), k
            assert torch.equal(staged.top_ids, ids.cpu()), k
