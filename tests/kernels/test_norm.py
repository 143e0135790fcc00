"""RMSNorm (+ fused residual add): twin vs a float64 oracle, Triton vs twin, CUDA graphs.

Fresh random inputs every run (seed printed by the `rng_seed` fixture). The Triton launcher
allocates its outputs; `poisoned_alloc` makes those allocations NaN-filled, so an element the
kernel fails to write fails the test. bf16 runs in the interpreter too: the kernel rounds with
integer ops there (see `kernels/triton/norm.py`), so its results are checked bit for bit.
"""

# Shape legend: T rows, H hidden size.

from __future__ import annotations

import pytest
import torch
from norm_checks import MANTISSA, check_vs_twin, check_zero_centred_vs_twin
from torch import Tensor

from freetoken_agent.kernels import reference
from freetoken_agent.kernels.norm import rms_norm

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
IDS = ["fp32", "fp16", "bf16"]


def make_inputs(seed: int, T: int, H: int, dtype: torch.dtype, device: str = DEV):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, H, generator=gen) * 3).to(device, dtype)
    residual = torch.randn(T, H, generator=gen).to(device, dtype)
    weight = (1 + 0.2 * torch.randn(H, generator=gen)).to(device, dtype)
    return x, residual, weight


def oracle(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None) -> tuple[Tensor, Tensor]:
    """float64 (y, s) from the dtype inputs: s exact, y = w * s / sqrt(mean(s^2) + eps)."""
    s = x.double() if residual is None else x.double() + residual.double()
    return weight.double() * s / (s.square().mean(-1, keepdim=True) + eps).sqrt(), s


# ---- the twin ----------------------------------------------------------------------------------


@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("H", [64, 100, 2048])
@pytest.mark.parametrize("dtype", [torch.float64, *DTYPES], ids=["fp64", *IDS])
def test_twin_matches_float64(rng_seed: int, dtype: torch.dtype, H: int,
                              with_residual: bool) -> None:  # fmt: skip
    x, residual, weight = make_inputs(rng_seed, 5, H, dtype, "cpu")
    residual = residual if with_residual else None
    eps = 1e-6
    out = reference.rms_norm(x, weight, eps, residual)
    y, s = out if with_residual else (out, None)
    y_ref, s_ref = oracle(x, weight, eps, residual)
    assert y.dtype == dtype and y.shape == x.shape
    # Unit roundoff u; y goes through (s,) n and w * n roundings, plus the fp32 (fp64) sum of
    # squares and rsqrt.
    u = 2.0 ** -(MANTISSA.get(dtype, 52) + 1)
    u_sum = 2.0**-53 if dtype == torch.float64 else 2.0**-24
    tiny = 1e-7 if dtype == torch.float16 else 1e-30  # fp16 subnormals
    assert ((y.double() - y_ref).abs() <= (4 * u + 16 * u_sum) * y_ref.abs() + tiny).all()
    if with_residual:
        assert s.dtype == dtype
        assert ((s.double() - s_ref).abs() <= u * s_ref.abs()).all()


def test_twin_eps_matters(rng_seed: int) -> None:
    """eps enters inside the rsqrt: a row of tiny values is not blown up to unit RMS."""
    x = torch.full((1, 64), 1e-4).double() * (1 + torch.rand(1, 64, dtype=torch.float64))
    w = torch.ones(64, dtype=torch.float64)
    y = reference.rms_norm(x, w, 1e-2)
    assert torch.allclose(y, x / (x.square().mean() + 1e-2).sqrt())


# ---- Triton (interpreter on the CPU, compiled on CUDA) vs the twin -----------------------------


@pytest.mark.usefixtures("poisoned_alloc")
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("H", [64, 100, 2048, 9000])  # 9000: walked in chunks
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_triton_matches_twin(rng_seed: int, dtype: torch.dtype, H: int,
                             with_residual: bool) -> None:  # fmt: skip
    T = 3 if H > 2048 else 6
    x, residual, weight = make_inputs(rng_seed, T, H, dtype)
    residual = residual if with_residual else None
    eps = 1e-5
    x0 = x.clone()
    out = rms_norm(x, weight, eps, residual, force_triton=True)
    ref = reference.rms_norm(x, weight, eps, residual)
    assert torch.equal(x, x0), "x was modified"
    if with_residual:
        (y, s), (y_ref, s_ref) = out, ref
        assert torch.equal(s, s_ref), "the residual sum must be exact"
    else:
        y, y_ref, s_ref = out, ref, x
    n_ref = reference.rms_norm(s_ref, torch.ones_like(weight), eps)  # w * n with w = 1 is n
    check_vs_twin(y, y_ref, n_ref, weight)


@pytest.mark.usefixtures("poisoned_alloc")
def test_triton_strided_rows(rng_seed: int) -> None:
    """Row-strided views (a slice of a wider buffer) are read in place."""
    x, residual, weight = make_inputs(rng_seed, 4, 160, torch.float16)
    xv, rv = x[:, 16:144], residual[:, :128]
    assert not xv.is_contiguous()
    y, s = rms_norm(xv, weight[:128].contiguous(), 1e-6, rv, force_triton=True)
    y_ref, s_ref = reference.rms_norm(xv, weight[:128], 1e-6, rv)
    assert torch.equal(s, s_ref) and y.is_contiguous()
    n_ref = reference.rms_norm(s_ref, torch.ones_like(y_ref[0]), 1e-6)
    check_vs_twin(y, y_ref, n_ref, weight[:128])


def test_triton_empty_batch() -> None:
    x = torch.empty(0, 64, device=DEV)
    y, s = rms_norm(x, torch.ones(64, device=DEV), 1e-6, x, force_triton=True)
    assert y.shape == s.shape == (0, 64)


def test_cpu_dispatch_is_the_twin(rng_seed: int) -> None:
    x, residual, weight = make_inputs(rng_seed, 3, 96, torch.bfloat16, "cpu")
    y, s = rms_norm(x, weight, 1e-6, residual)
    y_ref, s_ref = reference.rms_norm(x, weight, 1e-6, residual)
    assert torch.equal(y, y_ref) and torch.equal(s, s_ref)


# ---- CUDA: bf16 at the real shape, CUDA graphs -------------------------------------------------


@pytest.mark.gpu
@pytest.mark.usefixtures("poisoned_alloc")
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("T, H", [(1, 2048), (300, 2048), (4096, 2048), (7, 4096), (5, 10240)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gpu_matches_twin(rng_seed: int, dtype: torch.dtype, T: int, H: int,
                          with_residual: bool) -> None:  # fmt: skip
    x, residual, weight = make_inputs(rng_seed, T, H, dtype)
    residual = residual if with_residual else None
    out = rms_norm(x, weight, 1e-6, residual)
    ref = reference.rms_norm(x, weight, 1e-6, residual)
    if with_residual:
        (y, s), (y_ref, s_ref) = out, ref
        assert torch.equal(s, s_ref)
    else:
        y, y_ref, s_ref = out, ref, x
    n_ref = reference.rms_norm(s_ref, torch.ones_like(weight), 1e-6)
    check_vs_twin(y, y_ref, n_ref, weight)


@pytest.mark.gpu
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_gpu_cuda_graph_replay(rng_seed: int, with_residual: bool) -> None:
    torch.manual_seed(rng_seed)
    x, residual, weight = make_inputs(rng_seed, 4, 2048, torch.bfloat16)

    def step():
        return rms_norm(x, weight, 1e-6, residual if with_residual else None)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile outside the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    captured = captured if with_residual else (captured,)
    for _ in range(3):
        for t in (x, residual):  # in place: the graph keeps the addresses
            t.copy_(torch.randn_like(t) * 2)
        graph.replay()
        replayed = [c.clone() for c in captured]
        eager = step()
        for a, b in zip(replayed, eager if with_residual else (eager,), strict=True):
            assert torch.equal(a, b)


# ---- zero-centred weights (Qwen3-Next / Qwen3.5: y = n * (1 + w), one rounding) ------------------


def zero_centred_weight(seed: int, H: int, dtype: torch.dtype, device: str = DEV) -> Tensor:
    # Stored weights sit near 0 (the checkpoint holds w - 1); both signs, some large.
    gen = torch.Generator().manual_seed(seed + 1)
    return (0.3 * torch.randn(H, generator=gen)).to(device, dtype)


@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("dtype", [torch.float64, *DTYPES], ids=["fp64", *IDS])
def test_twin_zero_centred(rng_seed: int, dtype: torch.dtype, with_residual: bool) -> None:
    x, residual, _ = make_inputs(rng_seed, 5, 96, dtype, "cpu")
    weight = zero_centred_weight(rng_seed, 96, dtype, "cpu")
    residual = residual if with_residual else None
    out = reference.rms_norm(x, weight, 1e-6, residual, zero_centred=True)
    y, s = out if with_residual else (out, x)
    y_ref, _ = oracle(s, 1 + weight.double(), 1e-6, None)  # from the rounded sum
    u = 2.0 ** -(MANTISSA.get(dtype, 52) + 1)
    u_sum = 2.0**-53 if dtype == torch.float64 else 2.0**-24
    tiny = 1e-7 if dtype == torch.float16 else 1e-30
    # One rounding of y, plus fp32 (fp64) statistics, the 1 + w add and two products.
    assert ((y.double() - y_ref).abs() <= (u + 16 * u_sum) * y_ref.abs() + tiny).all()
    if dtype != torch.float32 and dtype != torch.float64:
        # Folding the +1 into the dtype weight (rounded) would differ in many elements.
        folded = reference.rms_norm(x, 1 + weight, 1e-6, residual)
        folded = folded[0] if with_residual else folded
        assert not torch.equal(folded, y)


@pytest.mark.usefixtures("poisoned_alloc")
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("H", [16, 100, 9000])  # 16: a per-head q/k norm; 9000: chunked
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_triton_zero_centred(rng_seed: int, dtype: torch.dtype, H: int,
                             with_residual: bool) -> None:  # fmt: skip
    T = 3 if H > 2048 else 6
    x, residual, _ = make_inputs(rng_seed, T, H, dtype)
    weight = zero_centred_weight(rng_seed, H, dtype)
    residual = residual if with_residual else None
    out = rms_norm(x, weight, 1e-6, residual, zero_centred=True, force_triton=True)
    ref = reference.rms_norm(x, weight, 1e-6, residual, zero_centred=True)
    if with_residual:
        (y, s), (y_ref, s_ref) = out, ref
        assert torch.equal(s, s_ref), "the residual sum must be exact"
    else:
        y, y_ref = out, ref
    check_zero_centred_vs_twin(y, y_ref)


@pytest.mark.gpu
@pytest.mark.usefixtures("poisoned_alloc")
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("T, H", [(1, 2048), (300, 2048), (4096, 256), (5, 10240)])
def test_gpu_zero_centred(rng_seed: int, T: int, H: int, with_residual: bool) -> None:
    x, residual, _ = make_inputs(rng_seed, T, H, torch.bfloat16)
    weight = zero_centred_weight(rng_seed, H, torch.bfloat16)
    residual = residual if with_residual else None
    out = rms_norm(x, weight, 1e-6, residual, zero_centred=True)
    ref = reference.rms_norm(x, weight, 1e-6, residual, zero_centred=True)
    if with_residual:
        (y, s), (y_ref, s_ref) = out, ref
        assert torch.equal(s, s_ref)
    else:
        y, y_ref = out, ref
    check_zero_centred_vs_twin(y, y_ref)
