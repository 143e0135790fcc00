"""The sampling kernel's greedy rows break ties as torch's argmax does, toward the lower id,
signed zeros included (-0.0 == +0.0, though their bits order them apart)."""

from __future__ import annotations

import random

import pytest
import torch

from freetoken_agent.engine.layers.sampler import kernel_rows
from freetoken_agent.engine.sampling_params import SamplingParams


def _ties(device: str, rng: random.Random) -> None:
    from freetoken_agent.kernels.triton.sampling import sample_rows

    for _ in range(2):  # small rows and slices: the interpreter is slow
        b, v = rng.randint(2, 4), rng.randint(20, 200)
        gen = torch.Generator().manual_seed(rng.getrandbits(32))
        logits = -torch.rand(b, v, generator=gen) * 5 - 0.1  # all below zero
        for row in range(b):  # the row's largest: zeros of both signs, -0.0 first
            at = sorted(rng.sample(range(v), rng.randint(2, 4)))
            logits[row, at] = 0.0
            logits[row, at[0]] = -0.0
        params = [SamplingParams(temperature=0)] * (b - 1) + [SamplingParams(temperature=0.7)]
        gens = [torch.Generator().manual_seed(rng.getrandbits(31)) for _ in range(b)]
        table = torch.tensor(kernel_rows(params, gens, v), dtype=torch.float64).to(device)
        drawn = sample_rows(logits.to(device), table, None, slice_size=64, cand=8)
        want = logits.argmax(dim=-1)
        assert torch.equal(drawn.tokens[: b - 1].cpu(), want[: b - 1]), (drawn.tokens, want)


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="the interpreter runs where CUDA is absent; see the gpu twin"
)
def test_greedy_ties_of_signed_zeros_go_to_the_lower_id_interpreted(rng_seed):
    _ties("cpu", random.Random(rng_seed))


@pytest.mark.gpu
def test_greedy_ties_of_signed_zeros_go_to_the_lower_id_on_cuda(rng_seed):
    _ties("cuda", random.Random(rng_seed))
