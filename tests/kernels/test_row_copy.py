"""row_copy: whole rows copied between banks by index in one launch (the Triton kernel in
Triton's interpreter here, compiled in the gpu test), strided banks as the elastic arena's slot
views are, equal to a loop of copies and touching nothing else."""

import random

import pytest
import torch

from freetoken_agent.kernels.row_copy import row_copy


def _strided_bank(rows: int, shape: tuple[int, int], pad: int, dtype, device) -> torch.Tensor:
    """[rows, *shape] views whose rows lie `pad` elements apart beyond their size (as slot views
    over units that hold two banks)."""
    n = shape[0] * shape[1]
    flat = torch.randn(rows * (n + pad), device=device).to(dtype)
    return flat.as_strided((rows, *shape), (n + pad, shape[1], 1)), flat


def _check(rng: random.Random, device: str, force_triton: bool) -> None:
    shape = (rng.randrange(1, 9), rng.randrange(1, 700))
    dtype = rng.choice([torch.float32, torch.float16] if device == "cpu" else [torch.bfloat16])
    src, _ = _strided_bank(rng.randrange(4, 12), shape, rng.randrange(0, 50), dtype, device)
    dst, flat = _strided_bank(rng.randrange(4, 12), shape, rng.randrange(0, 50), dtype, device)
    k = rng.randrange(0, min(src.shape[0], dst.shape[0]) + 1)
    s_rows, d_rows = rng.sample(range(src.shape[0]), k), rng.sample(range(dst.shape[0]), k)
    before = flat.clone()
    expect = dst.clone()
    for d, s in zip(d_rows, s_rows, strict=True):
        expect[d] = src[s]
    idx = {"dtype": torch.long, "device": device}
    row_copy(dst, src, torch.tensor(d_rows, **idx), torch.tensor(s_rows, **idx),
             force_triton=force_triton)  # fmt: skip
    assert torch.equal(dst, expect)
    # Nothing between the rows was written (the padding of each unit).
    n = shape[0] * shape[1]
    stride = dst.stride(0)
    pad_mask = (torch.arange(flat.numel(), device=device) % stride) >= n
    assert torch.equal(flat[pad_mask], before[pad_mask])


@pytest.mark.parametrize("force_triton", [False, True])
def test_row_copy_equals_a_loop_of_copies(rng_seed, force_triton):
    rng = random.Random(rng_seed)
    for _ in range(5):
        _check(rng, "cpu", force_triton)


def test_row_copy_refuses_rows_of_another_shape():
    with pytest.raises(ValueError, match="row shapes differ"):
        row_copy(torch.zeros(3, 2, 4), torch.zeros(3, 4, 2), torch.tensor([0]), torch.tensor([0]))


@pytest.mark.gpu
def test_gpu_row_copy_equals_a_loop_of_copies(rng_seed):
    rng = random.Random(rng_seed)
    for _ in range(5):
        _check(rng, "cuda", False)
