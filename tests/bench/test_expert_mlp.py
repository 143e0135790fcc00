"""bench expert-mlp's probe computes what the engine's MoE does for one token: the reference's
sum over the routed experts, within the fp32 sums' order (Triton's interpreter on the CPU, fresh
random inputs; widths that the slices do not divide)."""

from __future__ import annotations

import pytest
import torch

from freetoken_agent.bench.expert_mlp import expert_mlp
from freetoken_agent.kernels import reference

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # compiled on CUDA, interpreted on the CPU


@pytest.mark.parametrize("fma", [False, True], ids=["dot", "fma"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("slice_width", [16, 32])
def test_one_launch_is_the_experts_sum(rng_seed, slice_width, dtype, fma):
    """fp16 runs the act's split into two 16-bit parts (fp32 has nothing left for the second);
    bf16 is CUDA's only (the interpreter mangles bf16 into a dot)."""
    gen = torch.Generator().manual_seed(rng_seed)
    h = int(torch.randint(40, 300, (1,), generator=gen))
    i = int(torch.randint(20, 100, (1,), generator=gen))
    n, k = 12, int(torch.randint(1, 6, (1,), generator=gen))
    x = torch.randn(1, h, generator=gen)
    w13 = torch.randn(n, 2 * i, h, generator=gen) / h**0.5
    w2 = torch.randn(n, h, i, generator=gen) / i**0.5
    ids = torch.randperm(n, generator=gen)[:k]
    weights = torch.softmax(torch.randn(k, generator=gen), 0)
    x, w13, w2 = x.to(dtype), w13.to(dtype), w2.to(dtype)
    got = expert_mlp(x.to(DEV), w13.to(DEV), w2.to(DEV), ids.to(DEV), weights.to(DEV),
                     slice_width=slice_width, block_h=64, block_n=64, fma=fma).cpu()  # fmt: skip
    want = reference.fused_moe(x, w13, w2, ids[None].int(), weights[None])
    # fp32: the sums' order; fp16: that and one rounding of the output either side.
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("fma", [False, True], ids=["dot", "fma"])
def test_the_act_keeps_fp32_precision_through_16_bit_dots(rng_seed, fma):
    """fp16 weights: each pair's partials summed over its slices are its expert's output from
    an fp32 act (split into two 16-bit parts), within the fp32 sums' error; an act rounded to
    fp16 would be ~1e-3 off."""
    gen = torch.Generator().manual_seed(rng_seed)
    h, i, n, k = 96, 64, 6, 3
    x = torch.randn(1, h, generator=gen).half()
    w13 = (torch.randn(n, 2 * i, h, generator=gen) / h**0.5).half()
    w2 = (torch.randn(n, h, i, generator=gen) / i**0.5).half()
    ids = torch.randperm(n, generator=gen)[:k]
    weights = torch.softmax(torch.randn(k, generator=gen), 0)
    part = torch.empty(k, i // 16, h, device=DEV)
    expert_mlp(x.to(DEV), w13.to(DEV), w2.to(DEV), ids.to(DEV), weights.to(DEV), part=part,
               slice_width=16, block_h=32, block_n=32, fma=fma)  # fmt: skip
    part = part.cpu()
    xd = x.double()[0]
    for j, row in enumerate(ids.tolist()):
        g, u = w13[row, :i].double() @ xd, w13[row, i:].double() @ xd
        want = w2[row].double() @ (g * torch.sigmoid(g) * u)  # [H]
        got = part[j].double().sum(0)
        assert ((got - want).abs() <= 1e-5 * want.abs().max() + 1e-6).all(), j


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_the_tensor_descriptor_variant_is_the_experts_sum(rng_seed, dtype):
    """Weight tiles through tensor descriptors (TMA on Hopper): the same sum; the hidden size
    need not be a multiple of the tile (the descriptor pads with zeros), the width must be."""
    gen = torch.Generator().manual_seed(rng_seed)
    h = 8 * int(torch.randint(5, 38, (1,), generator=gen))  # rows 16-byte aligned (TMA)
    i = 32 * int(torch.randint(1, 4, (1,), generator=gen))
    n, k = 10, int(torch.randint(1, 6, (1,), generator=gen))
    x = torch.randn(1, h, generator=gen).to(dtype)
    w13 = (torch.randn(n, 2 * i, h, generator=gen) / h**0.5).to(dtype)
    w2 = (torch.randn(n, h, i, generator=gen) / i**0.5).to(dtype)
    ids = torch.randperm(n, generator=gen)[:k]
    weights = torch.softmax(torch.randn(k, generator=gen), 0)
    got = expert_mlp(x.to(DEV), w13.to(DEV), w2.to(DEV), ids.to(DEV), weights.to(DEV),
                     slice_width=32, block_h=64, block_n=64, tma=True).cpu()  # fmt: skip
    want = reference.fused_moe(x, w13, w2, ids[None].int(), weights[None])
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_the_read_only_rows_read_each_pair_once(rng_seed):
    """The read-only rows' kernel sums every element of each pair's w13 and w2 rows exactly
    once, whatever the chunks (a chunk reading into the next would count some twice)."""
    from freetoken_agent.bench.expert_mlp import _read_rows_kernel

    gen = torch.Generator().manual_seed(rng_seed)
    n, a, b = 7, int(torch.randint(5, 40, (1,), generator=gen)), 9
    w13 = torch.randn(n, 2 * a, b, generator=gen).to(DEV)
    w2 = torch.randn(n, b, a, generator=gen).to(DEV)
    ids = torch.randperm(n, generator=gen)[:3].to(DEV)
    chunks = int(torch.randint(1, 6, (1,), generator=gen))
    sink = torch.empty(3 * chunks, device=DEV)
    sizes = (w13.stride(0), w2.stride(0), w13[0].numel(), w2[0].numel())
    _read_rows_kernel[(3, chunks)](w13, w2, ids, sink, *sizes, CHUNKS=chunks, BLOCK=16)
    want = w13[ids].sum((1, 2)) + w2[ids].sum((1, 2))
    torch.testing.assert_close(sink.view(3, chunks).sum(1), want, atol=1e-4, rtol=1e-4)
