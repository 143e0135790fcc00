"""An attention layer's front in one launch (kernels/triton/norm_qkv.py): the input norm after
the residual add, the q/k/v projection, the per-head q/k norms, RoPE and the KV store. Checked
against the three kernels it fuses run apart (kernels/norm.py, F.linear, kernels/rope.py): s
is the norm kernel's, the projection (the partials it leaves in its scratch, summed in slice
order) is F.linear's of the norm kernel's rows within one ulp of the model dtype plus the fp32
sum's own error, and q, k and v are the rope kernel's of that projection bit for bit. Triton
runs in the interpreter on the CPU and compiled on CUDA; fresh random inputs every run."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from rope_cases import make_case, written
from sm90_compile import compiled_json

from freetoken_agent.kernels import reference
from freetoken_agent.kernels.gemv import MAX_M
from freetoken_agent.kernels.norm import rms_norm
from freetoken_agent.kernels.norm_qkv import norm_qkv_rope
from freetoken_agent.kernels.rope import qk_norm_rope_store

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
# bf16 on CUDA only: Triton's CPU interpreter mangles bf16 loads into the dot (test_gemv.py).
# bf16 compiled only (the interpreter mangles bf16 loads into the dot, test_gemv.py), and marked
# gpu so the device's `-m gpu` runs take it.
DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)]
DTYPE_IDS = ["fp32", "fp16", "bf16"]
EPS = 1e-6
# (Hq, Hkv, D, R, q/k norm): Qwen3's GQA with q/k norms; no norms (Mixtral); partial rotary with
# a head dim of 80 (16-column tiles); one kv head of 32 dims (the q norm alone).
LAYOUTS = [(8, 2, 64, 64, "qk"), (8, 2, 64, 64, "none"), (6, 2, 80, 32, "qk"), (4, 1, 32, 16, "q")]
LAYOUT_IDS = ["gqa-norm", "gqa", "partial-d80", "hkv1-qnorm"]


def _front(gen, seed: int, m: int, hidden: int, layout, dtype, residual: bool):
    """(rope case, x, residual or None, norm weight, w_qkv): fresh random inputs."""
    case = make_case(seed, m, *layout, dtype)
    hq, hkv, d = layout[:3]
    x = torch.randn(m, hidden, generator=gen).to(dtype).to(DEV)
    res = torch.randn(m, hidden, generator=gen).to(dtype).to(DEV) if residual else None
    norm_w = (1.0 + 0.2 * torch.randn(hidden, generator=gen)).to(dtype).to(DEV)
    w = (torch.randn((hq + 2 * hkv) * d, hidden, generator=gen) / hidden**0.5).to(dtype).to(DEV)
    return case, x, res, norm_w, w


def _rope_args(case, k_cache, v_cache) -> tuple:
    return (case.positions, case.cos, case.sin, case.hq, case.hkv, case.d, case.q_w, case.k_w,
            EPS, k_cache, v_cache, case.slots)  # fmt: skip


def _same_but_rare_flips(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Bit for bit in the interpreter (both kernels sum a head's squares alike there). Compiled,
    the rope kernel reduces several heads a program and this kernel one, so a head's fp32 sum
    of squares may differ in its last bit and flip a rounding of the normed value (as
    test_rope.py allows against the twin): a few elements, each within a few ulps."""
    if not CUDA:
        assert torch.equal(out, ref), f"{int((out != ref).sum())} elements differ"
        return
    diff = (out.double() - ref.double()).abs()
    allowed = 4 * torch.finfo(ref.dtype).eps * ref.double().abs().amax(-1, keepdim=True)
    assert (diff <= allowed).all(), f"max excess {(diff - allowed).max().item():.3g}"
    flips = int((diff > 0).sum())
    assert flips <= 4 + diff.numel() // 1000, f"{flips} elements differ: a systematic error"


def _projection(part: torch.Tensor, slices: int, m: int, n: int, dtype) -> torch.Tensor:
    """The kernel's projection: its fp32 partials summed in slice order, rounded: [M, N]."""
    p = part[: slices * m * n].view(slices, m, n)
    y = p[0].clone()
    for j in range(1, slices):
        y += p[j]
    return y.to(dtype)


@pytest.mark.usefixtures("poisoned_alloc")
@pytest.mark.parametrize("residual", [True, False], ids=["residual", "first-layer"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_one_launch_is_the_norm_the_projection_and_rope(rng_seed, dtype, layout, residual):
    from freetoken_agent.kernels.triton.gemv import splits
    from freetoken_agent.kernels.triton.norm_qkv import head_tiles, new_scratch

    gen = torch.Generator().manual_seed(rng_seed)
    m = int(torch.randint(1, MAX_M + 1, (1,), generator=gen))
    hidden = int(torch.randint(64, 700, (1,), generator=gen))  # not a multiple of the tiles
    case, x, res, norm_w, w = _front(gen, rng_seed, m, hidden, layout, dtype, residual)
    hq, hkv, d = layout[:3]
    n = w.shape[0]
    scratch = new_scratch(hq + 2 * hkv, d, hidden, m, x.device)
    k_cache, v_cache = case.fresh_caches()
    q, s = norm_qkv_rope(x, res, norm_w, EPS, False, w, *_rope_args(case, k_cache, v_cache),
                         scratch=scratch, force_triton=True)  # fmt: skip
    # The norm kernel's rows: s exactly, h for the projection's reference.
    if residual:
        h_ref, s_ref = rms_norm(x, norm_w, EPS, res, force_triton=True)
        assert torch.equal(s, s_ref), "the residual stream must be the norm kernel's"
    else:
        h_ref = rms_norm(x, norm_w, EPS, force_triton=True)
        assert s is x, "without a residual the stream is x itself"
    slices = splits(hidden, head_tiles(d, n, hidden))[0]
    y = _projection(scratch[0], slices, m, n, dtype)  # [M, N]
    want = F.linear(h_ref.double().cpu(), w.double().cpu())
    scale = F.linear(h_ref.double().abs().cpu(), w.double().abs().cpu())
    ulp = want.abs() * torch.finfo(dtype).eps
    assert ((y.double().cpu() - want).abs() <= ulp + 1e-5 * scale).all(), "projection off"
    # q, k and v: the rope kernel's of that projection (v raw, bit for bit).
    k_want, v_want = case.fresh_caches()
    q_want = qk_norm_rope_store(y.to(DEV), *_rope_args(case, k_want, v_want), force_triton=True)
    _same_but_rare_flips(q, q_want)
    k, v = written(case, k_cache, v_cache)  # and every other slot untouched
    k_ref, v_ref = written(case, k_want, v_want)
    _same_but_rare_flips(k, k_ref)
    assert torch.equal(v, v_ref), "the stored v differs"
    assert int(scratch[1].abs().sum()) == 0, "every head's counter is back to 0"


def test_the_input_norm_may_be_zero_centred(rng_seed):
    """(1 + w) input norms (Qwen3-Next's): the projection of the norm kernel's zero-centred
    rows."""
    gen = torch.Generator().manual_seed(rng_seed)
    case, x, res, norm_w, w = _front(gen, rng_seed, 2, 200, LAYOUTS[0], torch.float32, True)
    norm_w = 0.3 * torch.randn(200, generator=gen).to(DEV)
    k_cache, v_cache = case.fresh_caches()
    q, s = norm_qkv_rope(x, res, norm_w, EPS, True, w, *_rope_args(case, k_cache, v_cache),
                         force_triton=True)  # fmt: skip
    h_ref, s_ref = rms_norm(x, norm_w, EPS, res, zero_centred=True, force_triton=True)
    k_want, v_want = case.fresh_caches()
    q_want = qk_norm_rope_store(F.linear(h_ref, w), *_rope_args(case, k_want, v_want))
    assert torch.equal(s, s_ref)
    torch.testing.assert_close(q, q_want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_cache, k_want, atol=1e-5, rtol=1e-5, equal_nan=True)
    torch.testing.assert_close(v_cache, v_want, atol=1e-5, rtol=1e-5, equal_nan=True)


def test_back_to_back_launches_share_a_scratch(rng_seed):
    """One scratch, three launches (a graph's layers): each its own inputs' result, counters
    reset between them."""
    from freetoken_agent.kernels.triton.norm_qkv import new_scratch

    gen = torch.Generator().manual_seed(rng_seed)
    scratch = new_scratch(12, 64, 160, 2, torch.device(DEV))
    for i in range(3):
        case, x, res, norm_w, w = _front(gen, rng_seed + i, 2, 160, LAYOUTS[0], torch.float32,
                                         True)  # fmt: skip
        k_cache, v_cache = case.fresh_caches()
        q, s = norm_qkv_rope(x, res, norm_w, EPS, False, w, *_rope_args(case, k_cache, v_cache),
                             scratch=scratch, force_triton=True)  # fmt: skip
        k_want, v_want = case.fresh_caches()
        q_want, s_want = norm_qkv_rope(x, res, norm_w, EPS, False, w,
                                       *_rope_args(case, k_want, v_want))  # fmt: skip
        assert torch.equal(s, s_want)
        torch.testing.assert_close(q, q_want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(k_cache, k_want, atol=1e-5, rtol=1e-5, equal_nan=True)
        torch.testing.assert_close(v_cache, v_want, atol=1e-5, rtol=1e-5, equal_nan=True)
        assert int(scratch[1].abs().sum()) == 0


@pytest.mark.parametrize("shape", ["rows", "head-dim"])
def test_what_one_launch_cannot_take_runs_the_three_steps(rng_seed, shape, monkeypatch):
    """More rows than a decode step (MAX_M), or a head dim no 16-column tile divides: the
    norm, F.linear and the rope kernel, exactly, and no launch of the fused kernel."""
    from freetoken_agent.kernels.triton import norm_qkv as fused

    def refuse(*args, **kwargs):
        raise AssertionError("the fused kernel ran")

    monkeypatch.setattr(fused, "norm_qkv_rope", refuse)
    gen = torch.Generator().manual_seed(rng_seed)
    rows, layout = (MAX_M + 3, LAYOUTS[0]) if shape == "rows" else (2, (4, 2, 8, 8, "qk"))
    case, x, res, norm_w, w = _front(gen, rng_seed, rows, 96, layout, torch.float32, True)
    k_cache, v_cache = case.fresh_caches()
    q, s = norm_qkv_rope(x, res, norm_w, EPS, False, w, *_rope_args(case, k_cache, v_cache),
                         force_triton=True)  # fmt: skip
    h_ref, s_ref = reference.rms_norm(x, norm_w, EPS, res)
    k_want, v_want = case.fresh_caches()
    q_want = reference.qk_norm_rope_store(F.linear(h_ref, w), *_rope_args(case, k_want, v_want))
    assert torch.equal(s, s_ref)
    torch.testing.assert_close(q, q_want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k_cache, k_want, atol=1e-6, rtol=1e-6, equal_nan=True)


# The kernel at the 30B-A3B shape compiled for sm_90 (no GPU needed), under PDL `on` with the
# weights' prefetch, in a process of its own (this one imported the kernels under the
# interpreter).
_COMPILE = """
import json, re
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from freetoken_agent.kernels.triton.norm_qkv import _norm_qkv_kernel as fn
consts = dict(M=1, S=1, BLOCK_N=32, BLOCK_K=256, ROW=2048, PREC="tf32", MODE=3, HAS_RES=True,
              ZERO_CENTRED=False, HEAD_DIM=128, D_PAD=128, ROT=128, Q_NORM=True, K_NORM=True,
              PDL=7)
types = {n: "*bf16" for n in fn.arg_names if n.endswith("_ptr")}
types.update(part_ptr="*fp32", done_ptr="*i32", pos_ptr="*i64", slot_ptr="*i64", inv_h="fp32",
             eps="fp32", qk_eps="fp32", inv_d="fp32")
sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
ptx = compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32),
              options=dict(num_warps=4)).asm["ptx"]
print(json.dumps(ptx))
"""


def test_sm90_code_prefetches_waits_then_counts_each_head_once():
    """Compiled for the H200: no local memory (nothing spilled: the rows' statistics and the
    tiles stay in registers); the weights' L2 prefetch before PDL's wait and every load after
    it; one acquire-release add on a head's counter at GPU scope."""
    ptx = compiled_json(_COMPILE)
    assert ".local" not in ptx, "registers spilled"
    wait = ptx.index("griddepcontrol.wait")
    assert ptx.index("prefetch.global.L2 ") < wait < ptx.index("ld.global")
    assert len(re.findall(r"atom\.[.\w]*acq_rel[.\w]*", ptx)) == 1, "one counter add"
    assert re.search(r"atom\.[.\w]*gpu", ptx), "the counter at GPU scope"


@pytest.mark.gpu
def test_norm_qkv_replays_in_a_cuda_graph(rng_seed):
    """Captured once at the 30B-A3B shape (H 2048, 32 q and 4 kv heads of 128), replayed on new
    inputs: each replay is its own inputs' norm, F.linear and rope within bf16 rounding."""
    from freetoken_agent.kernels.triton.norm_qkv import new_scratch

    gen = torch.Generator().manual_seed(rng_seed)
    layout = (32, 4, 128, 128, "qk")
    case, x, res, norm_w, w = _front(gen, rng_seed, 1, 2048, layout, torch.bfloat16, True)
    scratch = new_scratch(40, 128, 2048, 1, x.device)
    k_cache, v_cache = case.fresh_caches()
    args = (x, res, norm_w, EPS, False, w, *_rope_args(case, k_cache, v_cache))
    norm_qkv_rope(*args, scratch=scratch)  # compile outside
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q, s = norm_qkv_rope(*args, scratch=scratch)
    for _ in range(3):
        x.copy_(torch.randn(1, 2048, generator=gen).to(torch.bfloat16))
        res.copy_(torch.randn(1, 2048, generator=gen).to(torch.bfloat16))
        graph.replay()
        h_ref, s_ref = reference.rms_norm(x, norm_w, EPS, res)
        k_want, v_want = case.fresh_caches()
        q_want = reference.qk_norm_rope_store(F.linear(h_ref, w),
                                              *_rope_args(case, k_want, v_want))  # fmt: skip
        torch.testing.assert_close(s, s_ref, atol=0.05, rtol=2**-7)
        torch.testing.assert_close(q, q_want, atol=0.05, rtol=2**-6)
        k, _ = written(case, k_cache, v_cache)
        k_ref, _ = written(case, k_want, v_want)
        torch.testing.assert_close(k, k_ref, atol=0.05, rtol=2**-6)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_the_config_switches_every_attention_layer(tmp_path, rng_seed, family):
    """EngineConfig.fused_norm_qkv reaches every attention layer whose front the kernel serves
    (Qwen3's per-head q/k norms, Mixtral's none); off, none. On the CPU the fused layer
    computes what the plain one does: the same tokens and logits."""
    from option_parity import assert_switch_reaches_layers_on_cpu

    assert_switch_reaches_layers_on_cpu(tmp_path, rng_seed, family, "fused_norm_qkv")


@pytest.mark.parametrize("family", ["olmoe", "qwen2_moe", "qwen3_next"])
def test_layers_the_kernel_cannot_serve_stay_apart(tmp_path, rng_seed, family):
    """OLMoE's norms over whole projections, Qwen2-MoE's q/k/v bias and Qwen3-Next's gated,
    zero-centred attention are not the kernel's cases: the switch leaves those layers alone."""
    from tiny_models import make_tiny

    from freetoken_agent import Engine
    from freetoken_agent.engine.models.base import DecoderLayer

    make_tiny(family, tmp_path, rng_seed)
    engine = Engine.load(tmp_path, device="cpu", progress=False, fused_norm_qkv=True)
    layers = [m for m in engine.loaded.model.modules() if isinstance(m, DecoderLayer)]
    assert layers and not any(m.fused_norm_qkv for m in layers)


def test_a_fused_layer_fuses_only_steps_of_few_rows(tmp_path, rng_seed, monkeypatch):
    """A layer with fused_norm_qkv sends steps of at most FUSED_NORM_QKV_ROWS rows to
    norm_qkv_rope, wider ones (prefill, two sequences) to the norm and the plain projection: a
    one-sequence decode calls it, and the tokens are the plain layer's."""
    from option_parity import assert_switch_keeps_tokens_on_cpu

    from freetoken_agent.engine.layers import attention
    from freetoken_agent.engine.models import base

    rows = []

    def counted(x, *args, **kwargs):
        rows.append(x.shape[0])
        return norm_qkv_rope(x, *args, **kwargs)

    monkeypatch.setattr(attention, "norm_qkv_rope", counted)
    assert_switch_keeps_tokens_on_cpu(tmp_path, rng_seed, "fused_norm_qkv")
    assert rows and max(rows) <= base.FUSED_NORM_QKV_ROWS


@pytest.mark.gpu
def test_engine_with_norm_qkv_matches_the_default_on_cuda(tmp_path, rng_seed):
    """The attention front in one launch gives the plain layers' tokens and logits (fp32,
    decode under graphs)."""
    from option_parity import assert_option_keeps_results_on_cuda

    assert_option_keeps_results_on_cuda(tmp_path, rng_seed, fused_norm_qkv=True)
