"""The router in one launch (kernels/triton/route.py): its logits are F.linear's within one ulp
of the model dtype, and its ids and weights are softmax_topk's of those logits. Triton runs in
the interpreter on the CPU and compiled on CUDA; fresh random inputs every run."""

from __future__ import annotations

import pytest
import torch
from router_checks import check_weights

from freetoken_agent.kernels import reference
from freetoken_agent.kernels.router import ROUTE_MAX_TOKENS, route

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
# (renormalize, round_to): Qwen3 (True, bf16), OLMoE (False, bf16), Mixtral (True, None)
MODES = [(True, torch.bfloat16), (False, torch.bfloat16), (True, None)]


def _close_to_linear(logits: torch.Tensor, x: torch.Tensor, w: torch.Tensor, dtype) -> bool:
    """Within one ulp of dtype at F.linear's value, plus the fp32 sum's own error in another
    order (1e-5 of sum |x_h w_h|: an h-term sum's rounding is ~sqrt(h) fp32 ulps of it)."""
    want = torch.nn.functional.linear(x.double(), w.double())  # [T, E]
    scale = torch.nn.functional.linear(x.double().abs(), w.double().abs())
    ulp = want.abs() * torch.finfo(dtype).eps
    return bool(((logits.double() - want).abs() <= ulp + 1e-5 * scale).all())


@pytest.mark.usefixtures("poisoned_alloc")
@pytest.mark.parametrize("mode", MODES, ids=["qwen", "olmoe", "mixtral"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["fp32", "fp16", "bf16"])  # fmt: skip
def test_route_is_the_linear_layer_then_softmax_topk(rng_seed, dtype, mode):
    from freetoken_agent.kernels.triton.route import scratch_logits

    renormalize, round_to = mode
    gen = torch.Generator().manual_seed(rng_seed)
    t = int(torch.randint(1, ROUTE_MAX_TOKENS + 1, (1,), generator=gen))
    h = int(torch.randint(40, 600, (1,), generator=gen))  # not a multiple of the tile
    e = int(torch.randint(9, 160, (1,), generator=gen))
    k = int(torch.randint(1, min(e, 8) + 1, (1,), generator=gen))
    x = torch.randn(t, h, generator=gen).to(dtype).to(DEV)
    w = (torch.randn(e, h, generator=gen) / h**0.5).to(dtype).to(DEV)
    ids, weights = route(x, w, k, renormalize, round_to, force_triton=True)
    logits = scratch_logits(x.device, t, e)  # [T, E] fp32 holding dtype's values
    assert torch.equal(logits, logits.to(dtype).float()), "logits not rounded to the dtype"
    assert _close_to_linear(logits.cpu(), x.cpu(), w.cpu(), dtype), "logits off F.linear's"
    # Low-precision logits tie exactly: the kernel takes the lowest index first (a stable
    # descending sort); the weights of tied experts are equal, so the twin's serve either way.
    order = torch.sort(logits.cpu(), dim=-1, descending=True, stable=True).indices[:, :k]
    assert torch.equal(ids.cpu(), order.int()), (ids.tolist(), order.tolist())
    _, w_ref = reference.softmax_topk(logits.to(dtype).cpu(), k, renormalize, round_to)
    _, unrounded = reference.softmax_topk(logits.to(dtype).cpu(), k, renormalize)
    check_weights(weights, w_ref, round_to, 1e-6, unrounded)


def test_route_back_to_back_calls_reset_the_counter(rng_seed):
    """The last program puts the counter back to 0: consecutive launches (a graph's layers)
    each pick their own experts."""
    gen = torch.Generator().manual_seed(rng_seed)
    for _ in range(3):
        x = torch.randn(2, 128, generator=gen).to(DEV)
        w = torch.randn(64, 128, generator=gen).to(DEV)
        ids, _ = route(x, w, 4, True, force_triton=True)
        ids_ref, _ = reference.softmax_topk(torch.nn.functional.linear(x, w), 4, True)
        assert torch.equal(ids.cpu(), ids_ref.cpu())


def test_a_prefill_chunk_takes_linear_then_softmax_topk(rng_seed):
    gen = torch.Generator().manual_seed(rng_seed)
    x = torch.randn(ROUTE_MAX_TOKENS + 5, 96, generator=gen)
    w = torch.randn(32, 96, generator=gen)
    ids, weights = route(x, w, 4, True)
    ids_ref, w_ref = reference.softmax_topk(torch.nn.functional.linear(x, w), 4, True)
    assert torch.equal(ids, ids_ref) and torch.allclose(weights, w_ref)


def test_the_config_switches_every_router(tmp_path, rng_seed):
    """EngineConfig.fused_router reaches every MoE router of the model; off, none."""
    from tiny_models import make_tiny

    from freetoken_agent import Engine
    from freetoken_agent.engine.layers.moe import TopKRouter

    make_tiny("qwen3_moe", tmp_path, rng_seed)
    for on in (False, True):
        engine = Engine.load(tmp_path, device="cpu", progress=False, fused_router=on)
        routers = [m for m in engine.loaded.model.modules() if isinstance(m, TopKRouter)]
        assert len(routers) > 1 and all(m.fused == on for m in routers)


@pytest.mark.gpu
def test_route_replays_in_a_cuda_graph(rng_seed):
    """Captured once, replayed on new inputs: each replay's ids are its own inputs' (the
    counter is back to 0 after every launch)."""
    gen = torch.Generator().manual_seed(rng_seed)
    t, h, e, k = 3, 2048, 128, 8
    x = torch.randn(t, h, generator=gen).to(torch.bfloat16).cuda()
    w = (torch.randn(e, h, generator=gen) / h**0.5).to(torch.bfloat16).cuda()
    route(x, w, k, True, torch.bfloat16)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ids, weights = route(x, w, k, True, torch.bfloat16)
    for _ in range(4):
        x.copy_(torch.randn(t, h, generator=gen).to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        logits = torch.nn.functional.linear(x, w).float().cpu()
        order = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :k]
        # cuBLAS's logits may sit one bf16 ulp from the kernel's: the sets agree but where
        # the k-th and (k+1)-th are that close.
        top = torch.sort(logits, dim=-1, descending=True).values
        clear = (top[:, k - 1] - top[:, k]) > 2 * top[:, k - 1].abs() * 2.0**-8
        for row in range(t):
            if clear[row]:
                assert set(ids[row].tolist()) == set(order[row].tolist()), row
        assert torch.allclose(weights.sum(-1).cpu(), torch.ones(t), atol=2e-2)


@pytest.mark.gpu
def test_engine_with_the_fused_router_matches_the_default_on_cuda(tmp_path, rng_seed):
    """The router in one launch gives F.linear + softmax_topk's tokens and logits (fp32,
    decode under graphs)."""
    from option_parity import assert_option_keeps_results_on_cuda

    assert_option_keeps_results_on_cuda(tmp_path, rng_seed, fused_router=True)


def test_every_tile_choice_routes_alike(rng_seed):
    """The default tiles and bench gemv's candidates: the same ids and weights."""
    from freetoken_agent.bench.gemv_kernel import ROUTE_SWEEP

    gen = torch.Generator().manual_seed(rng_seed)
    x = torch.randn(3, 300, generator=gen).to(DEV)
    w = torch.randn(37, 300, generator=gen).to(DEV)
    ids, weights = route(x, w, 5, True, force_triton=True)
    for tiles in ROUTE_SWEEP:
        from freetoken_agent.kernels.triton.route import route as triton_route

        got = triton_route(x, w, 5, True, None, tiles)
        assert torch.equal(got[0], ids) and torch.allclose(got[1], weights), tiles


def test_the_router_fuses_only_steps_of_few_rows(rng_seed, monkeypatch):
    """A fused router sends steps of at most FUSED_ROUTER_ROWS rows to `route` (measured
    faster there), wider ones to F.linear and softmax_topk; both answer alike."""
    from freetoken_agent.engine.layers import moe

    gen = torch.Generator().manual_seed(rng_seed)
    router = moe.TopKRouter(64, 16, moe.RouterOptions(top_k=4, norm_topk_prob=True))
    router.weight.copy_(torch.randn(16, 64, generator=gen) / 8)
    router.fused = True
    calls = []
    monkeypatch.setattr(moe, "route", lambda *a, **kw: calls.append(a[0].shape[0]) or route(*a))
    for rows in (1, moe.FUSED_ROUTER_ROWS, moe.FUSED_ROUTER_ROWS + 1, 7):
        x = torch.randn(rows, 64, generator=gen)
        ids, weights = router(x)
        ids_ref, w_ref = reference.softmax_topk(torch.nn.functional.linear(x, router.weight), 4,
                                                True, x.dtype)  # fmt: skip
        assert torch.equal(ids, ids_ref) and torch.allclose(weights, w_ref)
    assert calls == [1, moe.FUSED_ROUTER_ROWS]
