"""The o projection, the residual add and the RMSNorm in one launch (kernels/triton/
proj_norm.py): its projection (the partials it leaves in its scratch, summed in slice order) is
F.linear's within one ulp of the model dtype plus the fp32 sum's own error, and from there h and
s are the norm twin's of that projection, as the norm kernel's are. Triton runs in the
interpreter on the CPU and compiled on CUDA; fresh random inputs every run."""

from __future__ import annotations

import pytest
import torch
from norm_checks import check_vs_twin, check_zero_centred_vs_twin

from freetoken_agent.kernels import reference
from freetoken_agent.kernels.gemv import MAX_M
from freetoken_agent.kernels.proj_norm import proj_add_norm

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
# bf16 on CUDA only: Triton's CPU interpreter mangles bf16 loads into the dot (as test_gemv.py
# says); the norm's bf16 rounding is checked bit for bit in test_norm.py.
# (marked gpu so the device's `-m gpu` runs take it: unmarked, only a full run on a CUDA
# machine collected it, and the device's stages run `-m gpu`.)
DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)]
DTYPE_IDS = ["fp32", "fp16", "bf16"]


def _inputs(gen, m: int, k: int, n: int, dtype, zero_centred: bool = False):
    x = torch.randn(m, k, generator=gen).to(dtype).to(DEV)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype).to(DEV)
    residual = torch.randn(m, n, generator=gen).to(dtype).to(DEV)
    scale = 0.3 if zero_centred else 0.2
    norm_w = (0.0 if zero_centred else 1.0) + scale * torch.randn(n, generator=gen)
    return x, w, residual, norm_w.to(dtype).to(DEV)


def _projection(part: torch.Tensor, slices: int, m: int, n: int, dtype) -> torch.Tensor:
    """The kernel's y: its fp32 partials summed in slice order, rounded to dtype: [M, N]."""
    p = part[: slices * m * n].view(slices, m, n).cpu()
    y = p[0].clone()
    for j in range(1, slices):
        y += p[j]
    return y.to(dtype)


@pytest.mark.usefixtures("poisoned_alloc")
@pytest.mark.parametrize("zero_centred", [False, True], ids=["plain", "zero-centred"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_one_launch_is_the_projection_then_the_norm(rng_seed, dtype, zero_centred):
    from freetoken_agent.kernels.triton.gemv import choose_tiles, splits
    from freetoken_agent.kernels.triton.proj_norm import new_scratch

    gen = torch.Generator().manual_seed(rng_seed)
    m = int(torch.randint(1, MAX_M + 1, (1,), generator=gen))
    k = int(torch.randint(64, 1200, (1,), generator=gen))  # not a multiple of the tiles
    n = int(torch.randint(40, 700, (1,), generator=gen))
    x, w, residual, norm_w = _inputs(gen, m, k, n, dtype, zero_centred)
    scratch = new_scratch(n, k, x.device)
    eps = 1e-6
    h, s = proj_add_norm(x, w, residual, norm_w, eps, zero_centred, scratch=scratch,
                         force_triton=True)  # fmt: skip
    slices = splits(k, choose_tiles(n, k))[0]
    y = _projection(scratch[0], slices, m, n, dtype)  # [M, N]
    want = torch.nn.functional.linear(x.double().cpu(), w.double().cpu())
    scale = torch.nn.functional.linear(x.double().abs().cpu(), w.double().abs().cpu())
    ulp = want.abs() * torch.finfo(dtype).eps
    assert ((y.double() - want).abs() <= ulp + 1e-5 * scale).all(), "projection off F.linear's"
    h_ref, s_ref = reference.rms_norm(y, norm_w.cpu(), eps, residual.cpu(), zero_centred)
    assert torch.equal(s.cpu(), s_ref), "the residual sum must be exact"
    if zero_centred:
        check_zero_centred_vs_twin(h.cpu(), h_ref)
    else:
        n_ref = reference.rms_norm(s_ref, torch.ones_like(norm_w.cpu()), eps)
        check_vs_twin(h.cpu(), h_ref, n_ref, norm_w.cpu())
    assert int(scratch[1]) == 0, "the counter is back to 0 for the next launch"


def test_back_to_back_launches_share_a_scratch(rng_seed):
    """One scratch, three launches (a graph's layers): each its own inputs' result."""
    gen = torch.Generator().manual_seed(rng_seed)
    from freetoken_agent.kernels.triton.proj_norm import new_scratch

    scratch = new_scratch(96, 200, torch.device(DEV))
    for _ in range(3):
        x, w, residual, norm_w = _inputs(gen, 2, 200, 96, torch.float32)
        h, s = proj_add_norm(x, w, residual, norm_w, 1e-6, scratch=scratch, force_triton=True)
        h_ref, s_ref = reference.rms_norm(torch.nn.functional.linear(x, w), norm_w, 1e-6,
                                          residual)  # fmt: skip
        torch.testing.assert_close(s, s_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(h, h_ref, atol=1e-4, rtol=1e-4)


def test_more_rows_than_a_decode_step_take_linear_then_the_norm(rng_seed):
    gen = torch.Generator().manual_seed(rng_seed)
    x, w, residual, norm_w = _inputs(gen, MAX_M + 3, 64, 48, torch.float32)
    x, w, residual, norm_w = x.cpu(), w.cpu(), residual.cpu(), norm_w.cpu()
    h, s = proj_add_norm(x, w, residual, norm_w, 1e-6)
    h_ref, s_ref = reference.rms_norm(torch.nn.functional.linear(x, w), norm_w, 1e-6, residual)
    assert torch.equal(s, s_ref) and torch.equal(h, h_ref)


def test_an_empty_step_takes_linear_then_the_norm(rng_seed):
    """No rows (on by default, the fused layer may see an empty step): empty (h, s), not the
    kernel's 1 <= M assertion."""
    gen = torch.Generator().manual_seed(rng_seed)
    x, w, residual, norm_w = _inputs(gen, 1, 64, 48, torch.float32)
    x, residual = x[:0], residual[:0]
    h, s = proj_add_norm(x, w, residual, norm_w, 1e-6, force_triton=True)
    assert h.shape == s.shape == (0, 48)


def test_the_config_switches_every_attention_layer(tmp_path, rng_seed):
    """EngineConfig.fused_proj_norm reaches every attention layer (recurrent ones have no
    o_proj to fuse); off, none. On the CPU the fused layer computes what the plain one does."""
    from tiny_models import make_tiny

    from freetoken_agent import Engine, SamplingParams
    from freetoken_agent.engine.models.base import DecoderLayer

    make_tiny("qwen3_moe", tmp_path, rng_seed)
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    gen = torch.Generator().manual_seed(rng_seed)
    prompt = [int(t) for t in torch.randint(3, 300, (12,), generator=gen)]
    tokens = []
    for on in (False, True):
        engine = Engine.load(tmp_path, device="cpu", progress=False, fused_proj_norm=on)
        layers = [m for m in engine.loaded.model.modules() if isinstance(m, DecoderLayer)]
        assert len(layers) > 1 and all(m.fused_proj_norm == on for m in layers)
        tokens.append(engine.generate(prompt, sp).token_ids)
    assert tokens[0] == tokens[1]


@pytest.mark.gpu
def test_proj_norm_replays_in_a_cuda_graph(rng_seed):
    """Captured once at the 30B-A3B shape, replayed on new inputs: each replay is its own
    inputs' F.linear then norm, within bf16 rounding."""
    from freetoken_agent.kernels.triton.proj_norm import new_scratch

    gen = torch.Generator().manual_seed(rng_seed)
    x, w, residual, norm_w = _inputs(gen, 2, 4096, 2048, torch.bfloat16)
    scratch = new_scratch(2048, 4096, x.device)
    proj_add_norm(x, w, residual, norm_w, 1e-6, scratch=scratch)  # compile outside
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        h, s = proj_add_norm(x, w, residual, norm_w, 1e-6, scratch=scratch)
    for _ in range(3):
        x.copy_(torch.randn(2, 4096, generator=gen).to(torch.bfloat16))
        residual.copy_(torch.randn(2, 2048, generator=gen).to(torch.bfloat16))
        graph.replay()
        h_ref, s_ref = reference.rms_norm(torch.nn.functional.linear(x, w), norm_w, 1e-6,
                                          residual)  # fmt: skip
        torch.testing.assert_close(s, s_ref, atol=0.05, rtol=2**-7)
        torch.testing.assert_close(h, h_ref, atol=0.05, rtol=2**-6)


@pytest.mark.gpu
def test_engine_with_proj_norm_matches_the_default_on_cuda(tmp_path, rng_seed):
    """o_proj and the norm in one launch give the plain layer's tokens and logits (fp32,
    decode under graphs)."""
    from option_parity import assert_option_keeps_results_on_cuda

    assert_option_keeps_results_on_cuda(tmp_path, rng_seed, fused_proj_norm=True)


def test_a_fused_layer_fuses_only_steps_of_few_rows(tmp_path, rng_seed, monkeypatch):
    """A layer with fused_proj_norm sends steps of at most FUSED_PROJ_NORM_ROWS rows to
    proj_add_norm (measured faster there), wider ones to o_proj and its norm: a one-sequence
    decode calls it, a two-sequence one does not, and the tokens are the plain layer's."""
    from tiny_models import make_tiny

    from freetoken_agent import Engine, SamplingParams
    from freetoken_agent.engine.models import base

    make_tiny("qwen3_moe", tmp_path, rng_seed)
    rows = []

    def counted(x, *args, **kwargs):
        rows.append(x.shape[0])
        return proj_add_norm(x, *args)

    monkeypatch.setattr(base, "proj_add_norm", counted)
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    gen = torch.Generator().manual_seed(rng_seed)
    prompts = [[int(t) for t in torch.randint(3, 300, (n,), generator=gen)] for n in (9, 14)]
    out = {}
    for on in (False, True):
        engine = Engine.load(tmp_path, device="cpu", progress=False, fused_proj_norm=on)
        out[on] = [o.token_ids for o in engine.generate(prompts, sp)]
        out[on].append(engine.generate(prompts[0], sp).token_ids)
    assert out[True] == out[False]
    assert rows and max(rows) <= base.FUSED_PROJ_NORM_ROWS


def test_every_tile_choice_projects_and_norms_alike(rng_seed):
    """bench gemv's o_proj + norm candidates (K split 2 to 16 ways, 8 to 64 columns a program):
    each gives the default tiles' s and h within the fp32 sums' reordering, and leaves its
    counter at 0. K > 15 x 256, so the 16-way split runs 16 slices; random, so every candidate
    masks its last step."""
    from freetoken_agent.bench.gemv_kernel import SPLIT_SWEEP
    from freetoken_agent.kernels.triton.proj_norm import new_scratch
    from freetoken_agent.kernels.triton.proj_norm import proj_add_norm as triton_impl

    gen = torch.Generator().manual_seed(rng_seed)
    m = int(torch.randint(1, MAX_M + 1, (1,), generator=gen))
    k = int(torch.randint(3841, 4600, (1,), generator=gen))
    n = int(torch.randint(20, 100, (1,), generator=gen))
    x, w, residual, norm_w = _inputs(gen, m, k, n, torch.float32)
    h_ref, s_ref = reference.rms_norm(torch.nn.functional.linear(x.cpu(), w.cpu()),
                                      norm_w.cpu(), 1e-6, residual.cpu())  # fmt: skip
    for tiles in SPLIT_SWEEP:
        scratch = new_scratch(n, k, x.device, tiles)
        h, s = triton_impl(x, w, residual, norm_w, 1e-6, scratch=scratch, tiles=tiles)
        torch.testing.assert_close(s.cpu(), s_ref, atol=1e-5, rtol=1e-5, msg=str(tiles))
        torch.testing.assert_close(h.cpu(), h_ref, atol=1e-4, rtol=1e-4, msg=str(tiles))
        assert int(scratch[1]) == 0, tiles
