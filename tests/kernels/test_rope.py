"""Fused q/k norm + RoPE + KV store: twin vs a float64 oracle, Triton vs twin, CUDA graphs.

Fresh random inputs every run (seed printed by the `rng_seed` fixture). Caches start as NaN:
the mapped slots must be written (k normed and rotated, v raw) and every other slot must stay
NaN. The returned q is allocated by the launcher under `poisoned_alloc` (NaN-filled). bf16 runs
in the interpreter too, with the kernel's integer-op rounding (see `kernels/triton/norm.py`).
"""

# Shape legend: T tokens, Hq / Hkv query / kv heads, D head dim, R rotary dims, P pages of S slots.

from __future__ import annotations

import pytest
import torch
from rope_cases import EPS, Case, make_case, written
from torch import Tensor

from freetoken_agent.kernels import reference
from freetoken_agent.kernels.rope import qk_norm_rope_store

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
IDS = ["fp32", "fp16", "bf16"]
MANTISSA = {torch.float16: 10, torch.bfloat16: 7, torch.float32: 23, torch.float64: 52}
MIN_EXP = {torch.float16: -14, torch.bfloat16: -126, torch.float32: -126}


def ulp(x: Tensor, dtype: torch.dtype) -> Tensor:
    """One unit in the last place of dtype at |x| (float64)."""
    _, e = torch.frexp(x.double().abs())  # |x| = m * 2^e, 0.5 <= m < 1
    e = torch.where(x == 0, MIN_EXP[dtype], (e - 1).clamp(min=MIN_EXP[dtype]))
    return torch.ldexp(torch.ones_like(x, dtype=torch.float64), e - MANTISSA[dtype])


def partner_index(d: int, r: int) -> Tensor:
    """The rotate-half partner of each dim (d +- R/2 below R, itself above)."""
    half = r // 2
    return torch.cat((torch.arange(half, r), torch.arange(0, half), torch.arange(r, d)))


def oracle(c: Case) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """float64 (q, k, v, n_scale): pairs (a_i, b_i) = (x_i, x_{i+R/2}) rotated by their angle;
    n_scale = |normed x| + |normed partner| (the size of the terms, for tolerances)."""
    T, hq, hkv, d, r = c.qkv.shape[0], c.hq, c.hkv, c.d, c.cos.shape[1]
    x = c.qkv.double().cpu().view(T, hq + 2 * hkv, d)
    q, k, v = x[:, :hq], x[:, hq : hq + hkv], x[:, hq + hkv :]

    def norm(h: Tensor, w: Tensor | None) -> Tensor:
        if w is None:
            return h
        return w.double().cpu() * h / (h.square().mean(-1, keepdim=True) + EPS).sqrt()

    half = r // 2
    pos = c.positions.cpu()
    cos, sin = c.cos.double().cpu()[pos][:, None], c.sin.double().cpu()[pos][:, None]  # [T,1,R]

    def rope(h: Tensor) -> Tensor:
        a, b = h[..., :half], h[..., half:r]
        out = h.clone()
        out[..., :half] = a * cos[..., :half] - b * sin[..., :half]
        out[..., half:r] = b * cos[..., half:] + a * sin[..., half:]
        return out

    qn, kn = norm(q, c.q_w), norm(k, c.k_w)
    idx = partner_index(d, r)
    scale = torch.cat([h.abs() + h[..., idx].abs() * (idx != torch.arange(d)) for h in (qn, kn)], 1)
    return rope(qn), rope(kn), v, scale


def heads_normed(c: Case) -> tuple[Tensor, Tensor]:
    """Twin's normed heads before RoPE (weight applied), [T, H, D] for q and k."""
    T, d = c.qkv.shape[0], c.d
    x = c.qkv.view(T, c.hq + 2 * c.hkv, d)
    out = []
    for heads, w in ((x[:, : c.hq], c.q_w), (x[:, c.hq : c.hq + c.hkv], c.k_w)):
        flat = heads.reshape(-1, d)
        out.append((flat if w is None else reference.rms_norm(flat, w, EPS)).view_as(heads))
    return out[0], out[1]


def check_vs_twin(c: Case, out: Tensor, ref: Tensor, normed: Tensor, has_norm: bool) -> None:
    """Bitwise without norm weights (elementwise ops, same rounding points). With them the fp32
    sum of squares may flip one rounding of a normed value (and its partner's): bounded by a few
    ulps of the terms, and rare."""
    dtype = ref.dtype
    assert out.shape == ref.shape and out.dtype == dtype
    if dtype == torch.float32:
        tol = 2e-6 if has_norm else 1e-6  # fp32: ulps of reduction order (and FMA on the GPU)
        torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
        return
    if not has_norm:
        assert torch.equal(out, ref), f"{(out != ref).sum().item()} elements differ"
        return
    r = c.cos.shape[1]
    partner = normed[..., partner_index(c.d, r).to(normed.device)]
    scale = torch.maximum(torch.maximum(ref.abs(), normed.abs()), partner.abs())
    diff = (out.double() - ref.double()).abs()
    allowed = 4 * ulp(scale, dtype)
    assert (diff <= allowed).all(), f"max excess {(diff - allowed).max().item():.3g}"
    # A flip needs the fp32 statistics to land within an fp32 ulp or so of a rounding boundary;
    # a wrong rounding point or mode differs in a large fraction of the elements instead.
    mismatch = int((diff > 0).sum())
    print(f"{mismatch} of {diff.numel()} elements not bitwise equal")
    assert mismatch <= 4 + diff.numel() // 1000, f"{mismatch} elements differ: a systematic error"


# Layouts: (Hq, Hkv, D, R, norm). GQA with Qwen3's q/k norm; no norm (Mixtral); partial rotary
# with a non-power-of-two head dim; MHA with R = D = 96; one head per program (Hkv = 1); many
# kv heads per program with a small head dim; a q norm alone.
LAYOUTS = [
    (8, 2, 64, 64, "qk"),
    (8, 2, 64, 64, "none"),
    (6, 2, 80, 32, "qk"),
    (4, 4, 96, 96, "none"),
    (8, 1, 32, 16, "qk"),
    (16, 8, 16, 8, "q"),
]
LAYOUT_IDS = ["gqa-norm", "gqa", "partial-d80", "mha-d96", "hkv1", "hkv8-qnorm"]


# ---- the twin ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16],
                         ids=["fp64", "fp32", "bf16"])  # fmt: skip
@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_twin_matches_float64(rng_seed: int, layout: tuple, dtype: torch.dtype) -> None:
    c = make_case(rng_seed, 9, *layout, dtype, "cpu")
    qkv0 = c.qkv.clone()
    q = reference.qk_norm_rope_store(*c.args())
    assert torch.equal(c.qkv, qkv0), "qkv was modified"
    assert q.shape == (9, c.hq, c.d) and q.is_contiguous() and q.dtype == dtype
    k, v = written(c, c.k_cache, c.v_cache)
    q_ref, k_ref, v_ref, scale = oracle(c)
    u = 2.0 ** -(MANTISSA[dtype] + 1)
    u_sum = 2.0**-53 if dtype == torch.float64 else 2.0**-24  # sum of squares, rsqrt
    tol = (6 * u + 16 * u_sum) * scale
    assert ((q.double() - q_ref).abs() <= tol[:, : c.hq]).all()
    assert ((k.double() - k_ref).abs() <= tol[:, c.hq :]).all()
    assert torch.equal(v.double(), v_ref), "v must be stored raw"


# ---- Triton (interpreter on the CPU, compiled on CUDA) vs the twin -----------------------------


def run_both(c: Case) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(q, k, v) of the Triton kernel and of the twin, k / v read back from the mapped slots."""
    qkv0 = c.qkv.clone()
    k_cache, v_cache = c.fresh_caches()
    q = qk_norm_rope_store(*c.args(k_cache, v_cache), force_triton=True)
    assert torch.equal(c.qkv, qkv0), "qkv was modified"
    assert q.is_contiguous() and not q.isnan().any(), "q left (partly) unwritten"
    k, v = written(c, k_cache, v_cache)
    q_ref = reference.qk_norm_rope_store(*c.args())
    k_ref, v_ref = written(c, c.k_cache, c.v_cache)
    return q, k, v, q_ref, k_ref, v_ref


@pytest.mark.usefixtures("poisoned_alloc")
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_triton_matches_twin(rng_seed: int, layout: tuple, dtype: torch.dtype) -> None:
    c = make_case(rng_seed, 5, *layout, dtype)
    q, k, v, q_ref, k_ref, v_ref = run_both(c)
    q_n, k_n = heads_normed(c)
    check_vs_twin(c, q, q_ref, q_n, c.q_w is not None)
    check_vs_twin(c, k, k_ref, k_n, c.k_w is not None)
    assert torch.equal(v, v_ref)


def test_triton_empty_batch() -> None:
    c = make_case(0, 0, 4, 2, 32, 32, "qk", torch.float32)
    q = qk_norm_rope_store(*c.args(), force_triton=True)
    assert q.shape == (0, 4, 32) and c.k_cache.isnan().all() and c.v_cache.isnan().all()


def test_cpu_dispatch_is_the_twin(rng_seed: int) -> None:
    c = make_case(rng_seed, 3, 4, 2, 32, 16, "qk", torch.bfloat16, "cpu")
    k2, v2 = c.fresh_caches()
    q = qk_norm_rope_store(*c.args())
    assert torch.equal(q, reference.qk_norm_rope_store(*c.args(k2, v2)))
    assert torch.equal(c.k_cache.nan_to_num(), k2.nan_to_num())


# ---- CUDA: bf16 at the real shapes, CUDA graphs ------------------------------------------------

GPU_LAYOUTS = [
    (32, 4, 128, 128, "qk"),  # Qwen3-30B-A3B
    (32, 4, 128, 32, "qk"),  # partial rotary
    (32, 8, 128, 128, "none"),  # Mixtral
    (16, 2, 256, 64, "qk"),  # Qwen3-Next: D = 256, a quarter rotates
]


@pytest.mark.gpu
@pytest.mark.usefixtures("poisoned_alloc")
@pytest.mark.parametrize("T", [1, 333])
@pytest.mark.parametrize("layout", GPU_LAYOUTS, ids=["qwen3", "partial", "mixtral", "d256"])
def test_gpu_matches_twin(rng_seed: int, layout: tuple, T: int) -> None:
    c = make_case(rng_seed, T, *layout, torch.bfloat16, page=16)
    q, k, v, q_ref, k_ref, v_ref = run_both(c)
    q_n, k_n = heads_normed(c)
    check_vs_twin(c, q, q_ref, q_n, c.q_w is not None)
    check_vs_twin(c, k, k_ref, k_n, c.k_w is not None)
    assert torch.equal(v, v_ref)


@pytest.mark.gpu
def test_gpu_cuda_graph_replay(rng_seed: int) -> None:
    """Capture once; replay with new qkv, positions and slots written in place."""
    c = make_case(rng_seed, 4, 32, 4, 128, 128, "qk", torch.bfloat16, page=16)
    gen = torch.Generator().manual_seed(rng_seed + 1)

    def step() -> Tensor:
        return qk_norm_rope_store(*c.args())

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile outside the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q_static = step()
    P, S = c.k_cache.shape[:2]
    for _ in range(3):
        c.qkv.copy_(torch.randn(c.qkv.shape, generator=gen))
        c.positions.copy_(torch.randint(0, c.cos.shape[0], c.positions.shape, generator=gen))
        c.slots.copy_(torch.randperm(P * S, generator=gen)[: c.slots.shape[0]])
        for cache in (c.k_cache, c.v_cache):
            cache.fill_(float("nan"))
        graph.replay()
        q_replay, k_replay, v_replay = q_static.clone(), c.k_cache.clone(), c.v_cache.clone()
        for cache in (c.k_cache, c.v_cache):
            cache.fill_(float("nan"))
        q_eager = step()
        assert torch.equal(q_replay, q_eager)
        written(c, k_replay, v_replay)
        assert torch.equal(k_replay.nan_to_num(), c.k_cache.nan_to_num())
        assert torch.equal(v_replay.nan_to_num(), c.v_cache.nan_to_num())
