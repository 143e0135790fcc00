"""Parity with transformers on tiny random checkpoints of every family (CPU, fp32)."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import FAMILIES, HYBRID_FAMILIES, hf_greedy, make_tiny, max_rel_err

from freetoken_agent import Engine, SamplingParams


@pytest.fixture(params=(*FAMILIES, *HYBRID_FAMILIES))
def tiny(request, tmp_path, rng_seed):
    hf = make_tiny(request.param, tmp_path, rng_seed)
    engine = Engine.load(tmp_path, device="cpu", progress=False, kv_tokens=4096)
    return request.param, hf, engine, random.Random(rng_seed)


def test_score_matches_transformers(tiny):
    family, hf, engine, rng = tiny
    ids = [rng.randrange(3, 320) for _ in range(70)]
    ours = engine.score(ids)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert ours.shape == ref.shape == (70, 320)
    err = max_rel_err(ours, ref)
    print(family, "max relative error", err)
    assert err <= 1e-4
    engine.check_integrity()


def test_greedy_matches_transformers(tiny):
    family, hf, engine, rng = tiny
    prompt = [rng.randrange(3, 320) for _ in range(rng.randrange(5, 40))]
    ref = hf_greedy(hf, prompt, 32)
    out = engine.generate(prompt, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    assert out.token_ids == ref, f"{family}: diverged at {_first_diff(out.token_ids, ref)}"
    assert out.finish_reason == "length"


def test_batch_equals_alone(tiny):
    family, hf, engine, rng = tiny
    prompts = [[rng.randrange(3, 320) for _ in range(n)] for n in (3, 17, 41, 66)]
    sp = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    alone = [engine.generate(p, sp).token_ids for p in prompts]
    engine.radix.reset()  # no prefix reuse between the two runs
    batched = [o.token_ids for o in engine.generate(prompts, sp)]
    assert batched == alone
    engine.check_integrity()


def _first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), -1)
