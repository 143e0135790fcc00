"""The CPU branch's partial sum joins the MoE sum in fp32 (engine/experts/calibration.py
`cpu_experts`): a bf16 layer whose experts split between the slots and the CPU is rounded once,
as a resident layer is, not once on the CPU side and again after the add.

The tiny models route top-2, so the two sides' fp32 sum has the resident sum's association; what
is left is the CPU kernel's own fp32 dot-product order, which changes a bf16 value only at a
rounding boundary. The bound leaves room for that and is far below what the double rounding
gave (a large share of a split layer's values off by an ulp)."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import make_tiny

from freetoken_agent import Engine
from freetoken_agent.kernels.reference import fused_moe

# Of a split layer's values: the kernel's fp32 order at a bf16 rounding boundary changed at most
# 0.03% (20 seeds); the double rounding 4.5-8.7%.
DIFFERING_AT_MOST = 0.005


def _differing(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got != want).float().mean().item()


def _layer_call(engine: Engine, rng: random.Random, gen: torch.Generator, t: int):
    """A random MoE layer call of `t` bf16 tokens: (layer, (hidden [T, H], ids [T, K],
    weights [T, K])) and the resident sum of the pool's experts for it [T, H]."""
    spec, pool = engine.spec, engine.loaded.bank.pool
    e, k, h = spec.n_experts, spec.top_k, spec.hidden_size
    layer = rng.randrange(spec.n_moe_layers)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).int()
    hidden = torch.randn(t, h, generator=gen).to(torch.bfloat16)
    weights = torch.rand(t, k, generator=gen)
    want = fused_moe(hidden, pool.w13, pool.w2, ids + layer * e, weights)
    return layer, (hidden, ids, weights), want


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("policy", ["transfer", "adaptive"])
def test_a_split_prompt_layer_matches_resident_in_bf16(family, policy, tmp_path, rng_seed):
    """One slot: each prompt chunk's layer fetches one miss to its slot and runs the rest on
    the CPU (the eager path), so every layer's sum has both parts. Compared layer by layer:
    through a whole model one fp32-order flip at a rounding boundary spreads to the tokens
    after it (policy `cpu` shows it too), which would say nothing about the split."""
    make_tiny(family, tmp_path, rng_seed, dtype=torch.bfloat16)
    engine = Engine.load(tmp_path, device="cpu", policy=policy, expert_slots=1, progress=False)
    bank = engine.loaded.bank
    rng = random.Random(rng_seed)
    gen = torch.Generator().manual_seed(rng_seed)
    outs, wants = [], []
    for _ in range(8):
        layer, call, want = _layer_call(engine, rng, gen, rng.randint(8, 48))
        outs.append(bank(layer, *call))
        wants.append(want)
    assert bank.stats.on_cpu > 0 and bank.stats.fetched > 0  # both sides computed
    assert _differing(torch.cat(outs), torch.cat(wants)) <= DIFFERING_AT_MOST


@pytest.mark.parametrize("policy", ["transfer", "adaptive"])
def test_a_graph_decode_layer_adds_the_cpu_part_unrounded(policy, tmp_path, rng_seed):
    """The decode graphs' path (export, `resolve`, the segment after it), run eagerly on CPU
    tensors: the CPU's part is staged and added in fp32."""
    make_tiny("qwen3_moe", tmp_path, rng_seed, dtype=torch.bfloat16)
    engine = Engine.load(tmp_path, device="cpu", policy=policy, expert_slots=1, progress=False)
    bank = engine.loaded.bank
    io = bank.attach_graph_io(max_tokens=4, dtype=torch.bfloat16)
    io.active = True
    assert io.cpu_stage.dtype == io.cpu_part.dtype == torch.float32
    rng = random.Random(rng_seed)
    gen = torch.Generator().manual_seed(rng_seed)
    outs, wants = [], []
    for _ in range(24):
        layer, call, want = _layer_call(engine, rng, gen, rng.randint(2, 4))
        bank(layer, *call)  # the speculative segment: exports the routing
        bank.resolve(layer, len(want))
        outs.append(bank(layer, *call))  # the segment after resolve
        wants.append(want)
        assert not io.cpu_part.any()  # consumed by the sum
    assert bank.stats.on_cpu > 0 and bank.stats.fetched > 0
    assert _differing(torch.cat(outs), torch.cat(wants)) <= DIFFERING_AT_MOST
