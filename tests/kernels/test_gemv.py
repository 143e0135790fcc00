"""Skinny matmul (kernels/triton/gemv.py) against F.linear in float64: every M up to MAX_M,
widths that are not multiples of the tiles, split K, bias; the Triton kernel runs in the
interpreter on the CPU (tests/conftest.py) and natively on CUDA (the `gpu` test)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from freetoken_agent.kernels.gemv import MAX_M, gemv

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def _case(rng: random.Random, dtype: torch.dtype, device: str = "cpu"):
    m = rng.randint(1, MAX_M)
    n, k = rng.randint(1, 80), rng.randint(1, 300)
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    x = torch.randn(m, k, generator=gen).to(dtype).to(device)
    w = torch.randn(n, k, generator=gen).to(dtype).to(device)
    b = torch.randn(n, generator=gen).to(dtype).to(device) if rng.random() < 0.5 else None
    return x, w, b


def _want(x, w, b):
    return F.linear(x.double().cpu(), w.double().cpu(), None if b is None else b.double().cpu())


# bf16 runs on CUDA only (the `gpu` test): Triton's CPU interpreter mangles bf16 loads.
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_triton_gemv_matches_float64(rng_seed, dtype):
    rng = random.Random(rng_seed)
    for _ in range(4):
        x, w, b = _case(rng, dtype)
        want = _want(x, w, b)
        # fp16: the output's own rounding (2^-11 relative) and fp16 inputs to the dot
        tol = 1e-5 if dtype == torch.float32 else 5e-3
        scale = want.abs().max().item() + 1.0
        # Small tiles, so a few rows exercise every edge; one slice of K (the kernel writes
        # the output) and several (fp32 partials summed by the second launch).
        for split in (1, rng.randint(2, 4)):
            tiles = {"BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": split}
            got = gemv(x, w, b, force_triton=True, tiles=tiles)
            assert got.shape == (x.shape[0], w.shape[0]) and got.dtype == dtype
            err = (got.double() - want).abs().max().item()
            assert err <= tol * scale, (x.shape, w.shape, tiles)


def test_default_tiles_and_the_torch_fallback(rng_seed):
    """The tile choice splits K for a narrow weight; beyond MAX_M rows (and off CUDA without
    force_triton) the call is F.linear's."""
    from freetoken_agent.kernels.triton.gemv import choose_tiles

    assert choose_tiles(128, 2048)["SPLIT_K"] > 1  # the router: 4 column blocks alone
    assert choose_tiles(151936, 2048)["SPLIT_K"] == 1  # the lm_head fills the SMs by itself
    gen = torch.Generator().manual_seed(rng_seed)
    x, w = torch.randn(MAX_M + 1, 24, generator=gen), torch.randn(10, 24, generator=gen)
    assert torch.equal(gemv(x, w, force_triton=True), F.linear(x, w))
    assert torch.equal(gemv(x[:2], w), F.linear(x[:2], w))


@pytest.mark.gpu
def test_gemv_on_cuda_matches_float64_at_model_shapes(rng_seed):
    """The 30B-A3B decode projections at M = 1 and 4, default tiles, bf16."""
    gen = torch.Generator().manual_seed(rng_seed)
    for n, k in ((5120, 2048), (2048, 4096), (128, 2048), (151936, 2048)):
        w = (torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16).cuda()
        for m in (1, 4):
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16).cuda()
            got = gemv(x, w)
            want = _want(x, w, None)
            scale = want.abs().max().item() + 1e-3
            assert (got.double().cpu() - want).abs().max().item() <= 1e-2 * scale, (n, k, m)


def test_engine_switches_every_projection_with_the_config(tmp_path, rng_seed):
    """EngineConfig.skinny_gemv reaches every linear layer and router of the model (they then
    take the skinny matmul for decode-sized CUDA inputs); off, none."""
    from tiny_models import make_tiny

    from freetoken_agent import Engine
    from freetoken_agent.engine.layers.linear import Linear, ShardedLinear
    from freetoken_agent.engine.layers.moe import TopKRouter

    make_tiny("qwen3_moe", tmp_path, rng_seed)
    for on in (False, True):
        engine = Engine.load(tmp_path, device="cpu", progress=False, skinny_gemv=on)
        layers = [
            m
            for m in engine.loaded.model.modules()
            if isinstance(m, (Linear, ShardedLinear, TopKRouter))
        ]
        assert len(layers) > 3 and all(m.skinny == on for m in layers)


@pytest.mark.gpu
def test_engine_with_skinny_gemv_matches_the_default_on_cuda(tmp_path, rng_seed):
    """The skinny matmul gives cuBLAS's tokens and logits (fp32, decode under graphs)."""
    from option_parity import assert_option_keeps_results_on_cuda

    assert_option_keeps_results_on_cuda(tmp_path, rng_seed, skinny_gemv=True)
