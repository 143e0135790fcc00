"""The engine on CUDA (run on the device machine): bf16 parity with transformers, CUDA-graph
decode, batching and prefix reuse through the Triton kernels."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import FAMILIES, make_tiny, max_rel_err

from freetoken_agent import Engine, SamplingParams

pytestmark = pytest.mark.gpu


def _load(path, **options) -> Engine:
    return Engine.load(path, device="cuda", progress=False, max_model_len=1024, **options)


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_teacher_forced_parity(family, tmp_path, rng_seed):
    hf = make_tiny(family, tmp_path, rng_seed, dtype=torch.bfloat16).cuda()
    engine = _load(tmp_path)
    rng = random.Random(rng_seed)
    ids = [rng.randrange(3, 320) for _ in range(300)]
    with torch.no_grad():
        ref = hf(torch.tensor([ids], device="cuda")).logits[0].float().cpu()
    ours = engine.score(ids)
    err = max_rel_err(ours, ref)
    agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"{family}: bf16 max relative error {err:.2e}, argmax agreement {agree:.1%}")
    assert err <= 2e-2
    assert agree >= 0.95


def _check_greedy_against_scores(engine: Engine, prompt: list[int], tokens: list[int]) -> None:
    """Each decoded token is the argmax of the eagerly scored logits, up to bf16 noise."""
    logits = engine.score(prompt + tokens)[len(prompt) - 1 : -1]  # [n, V]
    chosen = logits.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    gap = (logits.max(-1).values - chosen) / logits.abs().max()
    assert gap.max().item() <= 2e-2, gap


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_graph_decode_and_batching(family, tmp_path, rng_seed):
    make_tiny(family, tmp_path, rng_seed, dtype=torch.bfloat16)
    engine = _load(tmp_path, max_num_seqs=8)
    assert engine.runner.graphs is not None
    rng = random.Random(rng_seed)
    prompts = [[rng.randrange(3, 320) for _ in range(n)] for n in (5, 70, 130, 260)]
    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    outs = engine.generate(prompts, sp)  # batched decode: graphs of size 4, then smaller
    for p, o in zip(prompts, outs, strict=True):
        _check_greedy_against_scores(engine, p, o.token_ids)
    engine.check_integrity()


def test_prefix_reuse_on_cuda(tmp_path, rng_seed):
    make_tiny("qwen2_moe", tmp_path, rng_seed, dtype=torch.bfloat16)
    engine = _load(tmp_path)
    rng = random.Random(rng_seed)
    prefix = [rng.randrange(3, 320) for _ in range(200)]
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    engine.generate(prefix + [5, 6, 7], sp)
    prompt = prefix + [9, 10, 11, 12]
    out = engine.generate(prompt, sp)
    assert out.stats["reused_tokens"] == 200 and out.stats["prefilled_tokens"] == 4
    _check_greedy_against_scores(engine, prompt, out.token_ids)
    engine.check_integrity()


def test_fp32_cuda_matches_cpu(tmp_path, rng_seed):
    make_tiny("olmoe", tmp_path, rng_seed)
    rng = random.Random(rng_seed)
    ids = [rng.randrange(3, 320) for _ in range(200)]
    cpu = Engine.load(tmp_path, device="cpu", progress=False, kv_tokens=2048).score(ids)
    gpu = _load(tmp_path).score(ids)
    err = max_rel_err(gpu, cpu)
    print(f"fp32 CUDA vs CPU max relative error {err:.2e}")
    assert err <= 5e-3  # tensor cores may run fp32 dots as tf32
