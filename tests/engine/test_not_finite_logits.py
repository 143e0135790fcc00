"""Logits that are not finite (NaN, +inf, or no finite allowed value) fail the request they
belong to with an error that says so, and nothing else: the sampler reports the row, its token
stays a valid id (the next step may be fed it before the host reads it), and the engine ends
that request alone."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import make_tiny

from freetoken_agent import Engine, SamplingParams
from freetoken_agent.engine import runner as runner_module
from freetoken_agent.engine.layers.sampler import NOT_FINITE, sample

INF = float("inf")


def _params(rng: random.Random, greedy_only: bool) -> SamplingParams:
    if greedy_only or rng.random() < 0.3:
        return SamplingParams(temperature=0)
    return SamplingParams(
        temperature=rng.uniform(0.3, 1.5),
        top_k=rng.choice([0, rng.randint(1, 20)]),
        top_p=rng.choice([1.0, rng.uniform(0.2, 0.95)]),
    )


def _break(logits: torch.Tensor, allowed: torch.Tensor | None, rng: random.Random) -> set[int]:
    """Break some rows where they may pick (NaN, +inf, or every allowed logit -inf); put NaN
    at a banned position of another row, which must not count. Returns the broken rows."""
    b, v = logits.shape
    broken = set(rng.sample(range(b), rng.randint(1, b - 1)))
    for row in broken:
        pickable = range(v) if allowed is None else allowed[row].nonzero().flatten().tolist()
        kind = rng.choice(["nan", "inf", "none"])
        if kind == "none":
            logits[row, list(pickable)] = -INF
        else:
            at = rng.sample(list(pickable), rng.randint(1, 3))
            logits[row, at] = float("nan") if kind == "nan" else INF
    if allowed is not None:
        for row in set(range(b)) - broken:
            banned = (~allowed[row]).nonzero().flatten().tolist()
            if banned:
                logits[row, rng.choice(banned)] = float("nan")
    return broken


def _case(rng: random.Random, greedy_only: bool, device: str = "cpu", most: int = 600):
    b, v = rng.randint(3, 8), rng.randint(40, most)
    gen = torch.Generator().manual_seed(rng.getrandbits(32))
    logits = torch.randn(b, v, generator=gen) * rng.uniform(0.5, 4)
    allowed = None
    if not greedy_only and rng.random() < 0.5:
        allowed = torch.rand(b, v, generator=gen) < rng.uniform(0.05, 0.9)
        allowed[torch.arange(b), torch.randint(0, v, (b,), generator=gen)] = True  # one a row
    params = [_params(rng, greedy_only) for _ in range(b)]
    seeds = [rng.getrandbits(31) for _ in range(b)]
    broken_logits = logits.clone()
    broken = _break(broken_logits, allowed, rng)
    if allowed is not None:
        allowed = allowed.to(device)
    return logits.to(device), broken_logits.to(device), allowed, params, seeds, broken


def _generators(seeds: list[int]) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(s) for s in seeds]


@pytest.mark.parametrize("greedy_only", [True, False])
def test_the_sampler_reports_rows_it_cannot_sample(rng_seed, greedy_only):
    """Broken rows are reported NOT_FINITE with a valid token; the other rows' tokens are the
    ones the clean logits give (their seeded draws untouched)."""
    rng = random.Random(rng_seed)
    for _ in range(6):
        clean, broken_logits, allowed, params, seeds, broken = _case(rng, greedy_only)
        want = sample(clean, params, _generators(seeds), allowed)
        assert (want.reported == want.tokens).all()
        got = sample(broken_logits, params, _generators(seeds), allowed)
        v = clean.shape[-1]
        assert ((got.tokens >= 0) & (got.tokens < v)).all(), got.tokens
        for row in range(clean.shape[0]):
            if row in broken:
                assert int(got.reported[row]) == NOT_FINITE, (row, got.reported)
            else:
                assert int(got.reported[row]) == int(got.tokens[row]) == int(want.tokens[row])


def _kernel_flags(device: str, rng: random.Random) -> None:
    from freetoken_agent.engine.layers.sampler import kernel_rows
    from freetoken_agent.kernels.triton.sampling import sample_rows

    for _ in range(2):  # small rows: the interpreter runs them slowly
        clean, broken_logits, allowed, params, seeds, broken = _case(rng, False, device, 200)
        table = torch.tensor(
            kernel_rows(params, _generators(seeds), clean.shape[-1]), dtype=torch.float64
        ).to(device)
        want = sample_rows(clean, table, allowed, slice_size=64, cand=8)
        got = sample_rows(broken_logits, table, allowed, slice_size=64, cand=8)
        assert torch.equal(want.reported, want.tokens)
        v = clean.shape[-1]
        assert ((got.tokens >= 0) & (got.tokens < v)).all(), got.tokens
        for row in range(clean.shape[0]):
            if row in broken:
                assert int(got.reported[row]) == NOT_FINITE and int(got.tokens[row]) == 0
            else:
                assert int(got.reported[row]) == int(got.tokens[row]) == int(want.tokens[row])


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="the interpreter runs where CUDA is absent; see the gpu twin"
)
def test_the_sampling_kernel_flags_rows_interpreted(rng_seed):
    """The Triton kernel under TRITON_INTERPRET (tests/conftest.py sets it without CUDA)."""
    _kernel_flags("cpu", random.Random(rng_seed))


@pytest.mark.gpu
def test_the_sampling_kernel_flags_rows_on_cuda(rng_seed):
    _kernel_flags("cuda", random.Random(rng_seed))


@pytest.fixture
def model_dir(tmp_path, rng_seed):
    make_tiny("qwen2_moe", tmp_path, rng_seed)
    return tmp_path


def _load(model_dir, overlap: bool) -> Engine:
    return Engine.load(model_dir, device="cpu", progress=False, kv_tokens=2048,
                       max_model_len=256, overlap_schedule=overlap)  # fmt: skip


@pytest.mark.parametrize("overlap", [False, True])
def test_one_request_with_nan_logits_fails_alone(model_dir, rng_seed, monkeypatch, overlap):
    """NaN put into one request's logits at a chosen output token fails that request with an
    error naming the fault and the position; its neighbours' tokens are those they get alone,
    and the engine serves the next request."""
    engine = _load(model_dir, overlap)
    rng = random.Random(rng_seed)
    prompts = [[rng.randrange(3, 320) for _ in range(rng.randint(4, 30))] for _ in range(3)]
    plain = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=8, temperature=0.8, seed=rng.getrandbits(31),
                            ignore_eos=True)  # fmt: skip
    victim_sp = SamplingParams(max_tokens=8, temperature=rng.choice([0, 0.7]), ignore_eos=True)
    alone = [engine.generate(prompts[0], plain).token_ids,
             engine.generate(prompts[1], seeded).token_ids]  # fmt: skip
    breaks_at = rng.randrange(0, 6)  # the output token whose logits go NaN
    real_sample = runner_module.sample

    def poisoned(logits, params, generators, allowed=None):
        for row, p in enumerate(params):
            request = engine._requests[victim]  # (it runs on its own copy of victim_sp)
            if p is request.sampling and len(request.output_ids) == breaks_at:
                logits[row, rng.randrange(logits.shape[-1])] = float("nan")
        return real_sample(logits, params, generators, allowed)

    monkeypatch.setattr(runner_module, "sample", poisoned)
    ids = [engine.submit(prompts[0], plain), engine.submit(prompts[1], seeded)]
    victim = engine.submit(prompts[2], victim_sp)
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
    failed = engine._collect(victim)
    assert failed.finish_reason == "error", failed
    assert "not finite" in failed.error and f"output token {breaks_at}" in failed.error
    assert len(failed.token_ids) == breaks_at
    assert [engine._collect(i).token_ids for i in ids] == alone
    monkeypatch.setattr(runner_module, "sample", real_sample)
    assert engine.generate(prompts[0], plain).token_ids == alone[0]


def test_a_model_that_computes_nan_fails_each_request_clearly(model_dir, rng_seed):
    """A NaN weight in the output head (as a broken checkpoint has): every request fails at
    its first token, saying why, and none hangs; with the head mended the engine serves again."""
    engine = _load(model_dir, overlap=True)
    rng = random.Random(rng_seed)
    prompt = [rng.randrange(3, 320) for _ in range(12)]
    sp = SamplingParams(max_tokens=5, temperature=rng.choice([0, 0.9]), ignore_eos=True)
    before = engine.generate(prompt, SamplingParams(max_tokens=5, temperature=0))
    head = engine.runner.model.lm_head.weight
    kept = head.detach().clone()
    with torch.no_grad():
        head[rng.randrange(head.shape[0]), rng.randrange(head.shape[1])] = float("nan")
    outs = engine.generate([prompt, prompt[:5]], sp)
    for out in outs:
        assert out.finish_reason == "error" and out.token_ids == []
        assert "not finite (NaN or inf) at output token 0" in out.error, out.error
    with torch.no_grad():
        head.copy_(kept)
    again = engine.generate(prompt, SamplingParams(max_tokens=5, temperature=0))
    assert again.token_ids == before.token_ids
    engine.check_integrity()
