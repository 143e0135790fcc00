"""A MoE layer in parts (kernels/moe_parts.py): the Triton path (interpreted on CPUs) against
the reference, and both against the one launch over a bank of every expert.

Shape legend: T tokens, H hidden, I expert width, E experts, K top-k.
"""

import random

import pytest
import torch

from freetoken_agent.kernels.fused_moe import fused_moe
from freetoken_agent.kernels.moe_parts import MoeParts
from freetoken_agent.kernels.reference import fused_moe as fused_moe_reference

triton_parts = pytest.importorskip("freetoken_agent.kernels.triton.moe_parts")
triton_prefill = pytest.importorskip("freetoken_agent.kernels.triton.moe_prefill").fused_moe_prefill

SMALL = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, DOWN_BLOCK_N=32, DOWN_BLOCK_K=16, SUM_BLOCK=32)


def layer_in_parts(rng: random.Random, dtype: torch.dtype, device: str = "cpu"):
    """A random layer (hidden, a bank of all E experts, top-k routing) and a random partition
    of its experts into parts, each with a bank of its own holding its experts at random rows
    among rows of garbage (NaN: a row read that is not the part's shows up)."""
    t, h, i = rng.randrange(1, 50), rng.choice([32, 64]), rng.choice([16, 32])
    e = rng.randrange(2, 12)
    k = rng.randrange(1, min(e, 4) + 1)
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    hidden = torch.randn(t, h, generator=g)
    w13 = torch.randn(e, 2 * i, h, generator=g) * (2 / h**0.5)
    w2 = torch.randn(e, h, i, generator=g) * (2 / i**0.5)
    ids = torch.rand(t, e, generator=g).topk(k, dim=1).indices.int()  # [T, K]
    weights = torch.softmax(torch.randn(t, k, generator=g), dim=1)
    n_parts = rng.randrange(1, e + 1)
    part_of = [rng.randrange(n_parts) for _ in range(e)]
    parts = []
    for p in range(n_parts):
        experts = [x for x in range(e) if part_of[x] == p]
        n_rows = len(experts) + rng.randrange(0, 3)
        where = rng.sample(range(n_rows), len(experts))
        b13 = torch.full((n_rows, 2 * i, h), float("nan"))
        b2 = torch.full((n_rows, h, i), float("nan"))
        rows = [-1] * e
        for x, r in zip(experts, where, strict=True):
            b13[r], b2[r], rows[x] = w13[x], w2[x], r
        cast = lambda a: a.to(device=device, dtype=dtype)  # noqa: E731
        parts.append((cast(b13), cast(b2), torch.tensor(rows, dtype=torch.int32, device=device)))
    cast = lambda a: a.to(device=device, dtype=dtype)  # noqa: E731
    return cast(hidden), cast(w13), cast(w2), ids.to(device), weights.to(device), parts


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_parts_match_the_reference_parts_and_the_one_launch(rng_seed, dtype):
    rng = random.Random(rng_seed)
    for _ in range(6):
        hidden, w13, w2, ids, weights, parts = layer_in_parts(rng, dtype)
        whole = fused_moe_reference(hidden, w13, w2, ids, weights)
        e, width = w13.shape[0], w2.shape[2]
        max_pairs = rng.choice([8, 32, 4096])  # several token chunks, or one
        plans, tiles = triton_parts.plan_parts(ids, e, hidden.shape[1], width, max_pairs, SMALL)
        ref = MoeParts(hidden, ids, weights, e, width, max_pairs)  # the twin on CPU tensors
        sums = [torch.full(hidden.shape, float("nan")) for _ in range(2)]  # fp32, in turn
        out = torch.full_like(hidden, float("nan"))
        for n, (b13, b2, rows) in enumerate(parts):
            last = n == len(parts) - 1
            ref.add(b13, b2, rows, last)
            add = None if n == 0 else sums[(n - 1) % 2]
            triton_parts.fused_moe_part(hidden, b13, b2, rows, ids, weights, plans, tiles,
                                        out if last else sums[n % 2], add)  # fmt: skip
        tol = 2e-5 if dtype == torch.float32 else 3e-3
        for got in (ref.out, out):
            assert torch.isfinite(got).all(), "a part read a row that is not its own"
            err = ((got.double() - whole.double()).norm() / whole.double().norm()).item()
            assert err < tol, f"seed={rng_seed}"
        if len(parts) == 1:  # one part is the one launch, bit for bit
            one = fused_moe(hidden, parts[0][0], parts[0][1], parts[0][2][ids.long()], weights)
            assert torch.equal(ref.out, one)
        # Rounded once: the Triton parts round as the one Triton launch over the whole bank
        # does, but where the sum's order tips an element over (rounding each part moves most).
        one = triton_prefill(
            hidden, w13, w2, ids, weights, tiles={**SMALL, "CHUNK_PAIRS": max_pairs}
        )
        if dtype == torch.float16:
            assert (out != one).float().mean().item() <= 0.02, f"seed={rng_seed}"
        else:
            assert ((out - one).norm() / one.norm()).item() < 1e-6, f"seed={rng_seed}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_parts_on_cuda_match_the_one_launch(rng_seed, dtype):
    """On CUDA the parts (the Triton path, its fp32 sums in turn) give the one launch over a
    bank of every expert: fp32 within rounding of the sum's order, bf16 rounded alike but
    where that order tips an element over."""
    rng = random.Random(rng_seed)
    for _ in range(10):
        hidden, w13, w2, ids, weights, parts = layer_in_parts(rng, dtype, "cuda")
        e, width = w13.shape[0], w2.shape[2]
        got = MoeParts(hidden, ids, weights, e, width, rng.choice([16, 64, 16384]))
        for n, (b13, b2, rows) in enumerate(parts):
            got.add(b13, b2, rows, last=n == len(parts) - 1)
        one = triton_prefill(hidden, w13, w2, ids, weights)
        assert torch.isfinite(got.out).all(), "a part read a row that is not its own"
        if dtype == torch.float32:
            assert ((got.out - one).norm() / one.norm()).item() < 1e-6, f"seed={rng_seed}"
        else:
            assert (got.out != one).float().mean().item() <= 0.02, f"seed={rng_seed}"
