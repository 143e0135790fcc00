"""Router softmax + top-k: twin vs a float64 oracle, Triton vs twin, CUDA graphs.

Fresh random inputs every run (seed printed by the `rng_seed` fixture). Logits are redrawn until
no two of a row's top k + 1 probabilities lie within a relative 1e-4, so the top-k ids are
well defined and must match exactly (a separate test covers exact ties). The launcher's outputs
are allocated NaN / INT_MIN-filled under `poisoned_alloc`, so an unwritten element fails.
"""

# Shape legend: T tokens, E experts, K top-k.

from __future__ import annotations

import pytest
import torch
from router_checks import check_weights
from torch import Tensor

from freetoken_agent.kernels import reference
from freetoken_agent.kernels.router import softmax_topk

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
IDS = ["fp32", "fp16", "bf16"]
# (renormalize, round_to): Mixtral (True, None), Qwen (True, bf16), OLMoE (False, bf16), and
# neither.
MODES = [(False, None), (True, None), (True, torch.bfloat16), (False, torch.bfloat16)]
MODE_IDS = ["raw", "renorm", "renorm-bf16", "bf16"]


def draw_logits(gen: torch.Generator, T: int, E: int, K: int, dtype: torch.dtype,
                device: str = DEV, scale: float = 2.0) -> Tensor:  # fmt: skip
    """[T, E] logits in dtype whose top K + 1 probabilities are pairwise >= 1e-4 apart."""
    logits = (torch.randn(T, E, generator=gen) * scale).to(dtype)
    for _ in range(1000):
        top = torch.softmax(logits.double(), -1).topk(min(K + 1, E), -1).values  # descending
        near = ((top[:, :-1] - top[:, 1:]) < 1e-4 * top[:, :-1]).any(-1)  # [T]
        if not near.any():
            return logits.to(device)
        logits[near] = (torch.randn(int(near.sum()), E, generator=gen) * scale).to(dtype)
    raise AssertionError("could not draw tie-free logits")


def oracle(logits: Tensor, k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    """float64 ids / weights by a stable descending sort (ties: lowest index first)."""
    probs = torch.softmax(logits.double().cpu(), -1)
    weights, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, ids = weights[:, :k], ids[:, :k]
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return ids.to(torch.int32), weights


# ---- the twin ----------------------------------------------------------------------------------


@pytest.mark.parametrize("E", [8, 60, 128])
@pytest.mark.parametrize("K", [1, 2, 8])
def test_twin_matches_float64(rng_seed: int, E: int, K: int) -> None:
    gen = torch.Generator().manual_seed(rng_seed)
    for dtype in (torch.float64, *DTYPES):
        logits = draw_logits(gen, 16, E, K, dtype, "cpu")
        for renormalize, round_to in MODES:
            ids, w = reference.softmax_topk(logits, K, renormalize, round_to)
            ids_ref, w_ref = oracle(logits, K, renormalize)
            assert ids.dtype == torch.int32 and torch.equal(ids, ids_ref), (dtype, renormalize)
            wide = torch.float64 if dtype == torch.float64 else torch.float32
            assert w.dtype == wide, (w.dtype, dtype)
            if round_to is None:
                tol = 1e-12 if dtype == torch.float64 else 1e-6
                torch.testing.assert_close(w.double(), w_ref, atol=tol, rtol=0)
            else:  # one rounding to bf16 of a value within fp32 ulps of the oracle's
                assert ((w.double() - w_ref).abs() <= w_ref * 2.0**-8 * 1.01).all()


# ---- Triton (interpreter on the CPU, compiled on CUDA) vs the twin -----------------------------


@pytest.mark.usefixtures("poisoned_alloc")
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("K", [1, 2, 8])
@pytest.mark.parametrize("E", [8, 60, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_triton_matches_twin(rng_seed: int, dtype: torch.dtype, E: int, K: int,
                             mode: tuple) -> None:  # fmt: skip
    renormalize, round_to = mode
    logits = draw_logits(torch.Generator().manual_seed(rng_seed), 6, E, K, dtype)
    ids, w = softmax_topk(logits, K, renormalize, round_to, force_triton=True)
    ids_ref, w_ref = reference.softmax_topk(logits, K, renormalize, round_to)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    assert torch.equal(ids, ids_ref), f"ids {ids.tolist()} != {ids_ref.tolist()}"
    check_weights(w, w_ref, round_to, 1e-6, reference.softmax_topk(logits, K, renormalize)[1])


@pytest.mark.usefixtures("poisoned_alloc")
def test_triton_wide_router(rng_seed: int) -> None:
    """E = 512 (padded lanes none), K = 16 (the largest), a non-power-of-two K = 6 too."""
    gen = torch.Generator().manual_seed(rng_seed)
    for E, K in ((512, 16), (384, 6)):
        logits = draw_logits(gen, 3, E, K, torch.float16)
        ids, w = softmax_topk(logits, K, True, torch.bfloat16, force_triton=True)
        ids_ref, w_ref = reference.softmax_topk(logits, K, True, torch.bfloat16)
        assert torch.equal(ids, ids_ref)
        check_weights(w, w_ref, torch.bfloat16, 0, reference.softmax_topk(logits, K, True)[1])


@pytest.mark.usefixtures("poisoned_alloc")
def test_triton_ties_take_the_lowest_index(rng_seed: int) -> None:
    """Exact ties (repeated logits): descending probability, lowest index first among equals."""
    gen = torch.Generator().manual_seed(rng_seed)
    logits = torch.randint(-3, 3, (8, 60), generator=gen).float().to(DEV)  # many equal values
    ids, w = softmax_topk(logits, 8, False, force_triton=True)
    ids_ref, w_ref = oracle(logits, 8, False)
    assert torch.equal(ids.cpu(), ids_ref), f"{ids.tolist()} != {ids_ref.tolist()}"
    torch.testing.assert_close(w.double().cpu(), w_ref, atol=1e-6, rtol=0)


def test_triton_strided_rows(rng_seed: int) -> None:
    """Logits as a row-strided view (e.g. a slice of a fused projection)."""
    gen = torch.Generator().manual_seed(rng_seed)
    buffer = torch.randn(4, 72, generator=gen).to(DEV)
    buffer[:, :64] = draw_logits(gen, 4, 64, 4, torch.float32)
    logits = buffer[:, :64]
    assert not logits.is_contiguous()
    ids, w = softmax_topk(logits, 4, True, force_triton=True)
    ids_ref, w_ref = reference.softmax_topk(logits, 4, True)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, atol=1e-6, rtol=0)


def test_triton_empty_batch() -> None:
    ids, w = softmax_topk(torch.empty(0, 64, device=DEV), 8, True, force_triton=True)
    assert ids.shape == w.shape == (0, 8)


def test_cpu_dispatch_is_the_twin(rng_seed: int) -> None:
    logits = draw_logits(torch.Generator().manual_seed(rng_seed), 5, 64, 8, torch.bfloat16, "cpu")
    ids, w = softmax_topk(logits, 8, True, torch.bfloat16)
    ids_ref, w_ref = reference.softmax_topk(logits, 8, True, torch.bfloat16)
    assert torch.equal(ids, ids_ref) and torch.equal(w, w_ref)


# ---- CUDA: bf16 at the real shapes, CUDA graphs ------------------------------------------------


@pytest.mark.gpu
@pytest.mark.usefixtures("poisoned_alloc")
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("T", [1, 1000])
@pytest.mark.parametrize("E", [128, 256, 512])
def test_gpu_matches_twin(rng_seed: int, E: int, T: int, mode: tuple) -> None:
    renormalize, round_to = mode
    logits = draw_logits(torch.Generator().manual_seed(rng_seed), T, E, 8, torch.bfloat16)
    ids, w = softmax_topk(logits, 8, renormalize, round_to)
    ids_ref, w_ref = reference.softmax_topk(logits, 8, renormalize, round_to)
    assert torch.equal(ids, ids_ref)
    check_weights(w, w_ref, round_to, 1e-6, reference.softmax_topk(logits, 8, renormalize)[1])


@pytest.mark.gpu
def test_gpu_cuda_graph_replay(rng_seed: int) -> None:
    gen = torch.Generator().manual_seed(rng_seed)
    logits = draw_logits(gen, 4, 128, 8, torch.bfloat16)

    def step() -> tuple[Tensor, Tensor]:
        return softmax_topk(logits, 8, True, torch.bfloat16)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile outside the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ids_static, w_static = step()
    for _ in range(3):
        logits.copy_(draw_logits(gen, 4, 128, 8, torch.bfloat16))  # in place
        graph.replay()
        ids_replay, w_replay = ids_static.clone(), w_static.clone()
        ids, w = step()
        assert torch.equal(ids_replay, ids) and torch.equal(w_replay, w)
