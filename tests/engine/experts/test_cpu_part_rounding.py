"""The CPU branch's partial sum joins the MoE sum in fp32 (engine/experts/calibration.py
`cpu_experts`): a bf16 layer whose experts split between the slots and the CPU is rounded once,
as a resident layer is, not once on the CPU side and again after the add.

The tiny models route top-2, so the two sides' fp32 sum has the resident sum's association and
a split layer's bf16 output is the resident's bit for bit; the bounds below leave room for the
CPU kernel's own fp32 dot-product order (another SIMD width) at a rounding boundary, and are
far below what the double rounding gave (40-70% of the logits changed)."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import make_tiny

from freetoken_agent import Engine
from freetoken_agent.kernels.reference import fused_moe

DIFFERING_AT_MOST = 0.02  # of the values: fp32-order noise at a bf16 rounding boundary


def _differing(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got != want).float().mean().item()


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("policy", ["transfer", "adaptive"])
def test_a_split_prompt_matches_resident_in_bf16(family, policy, tmp_path, rng_seed):
    """One slot: each chunk's layer fetches one miss to its slot and runs the rest on the CPU
    (the eager path), so every layer's sum has both parts."""
    make_tiny(family, tmp_path, rng_seed, dtype=torch.bfloat16)
    rng = random.Random(rng_seed)
    ids = [rng.randrange(3, 320) for _ in range(rng.randint(24, 64))]
    want = Engine.load(tmp_path, device="cpu", policy="resident", progress=False).score(ids)
    engine = Engine.load(tmp_path, device="cpu", policy=policy, expert_slots=1, progress=False)
    got = engine.score(ids)
    assert got.dtype == want.dtype
    st = engine.stats()["experts"]
    assert st["on_cpu"] > 0 and st["fetched"] > 0  # both sides computed
    assert _differing(got, want) <= DIFFERING_AT_MOST


@pytest.mark.parametrize("policy", ["transfer", "adaptive"])
def test_a_graph_decode_layer_adds_the_cpu_part_unrounded(policy, tmp_path, rng_seed):
    """The decode graphs' path (export, `resolve`, the segment after it), run eagerly on CPU
    tensors: the CPU's part is staged and added in fp32."""
    make_tiny("qwen3_moe", tmp_path, rng_seed, dtype=torch.bfloat16)
    engine = Engine.load(tmp_path, device="cpu", policy=policy, expert_slots=1, progress=False)
    bank, spec = engine.loaded.bank, engine.spec
    io = bank.attach_graph_io(max_tokens=4, dtype=torch.bfloat16)
    io.active = True
    assert io.cpu_stage.dtype == io.cpu_part.dtype == torch.float32
    e, k, h = spec.n_experts, spec.top_k, spec.hidden_size
    gen = torch.Generator().manual_seed(rng_seed)
    rng = random.Random(rng_seed)
    outs, wants = [], []
    for _ in range(24):
        layer, t = rng.randrange(spec.n_moe_layers), rng.randint(2, 4)
        ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).int()
        hidden = torch.randn(t, h, generator=gen).to(torch.bfloat16)
        weights = torch.rand(t, k, generator=gen)
        bank(layer, hidden, ids, weights)  # the speculative segment: exports the routing
        bank.resolve(layer, t)
        outs.append(bank(layer, hidden, ids, weights))  # the segment after resolve
        wants.append(fused_moe(hidden, bank.pool.w13, bank.pool.w2, ids + layer * e, weights))
        assert not io.cpu_part.any()  # consumed by the sum
    assert bank.stats.on_cpu > 0 and bank.stats.fetched > 0
    assert _differing(torch.cat(outs), torch.cat(wants)) <= DIFFERING_AT_MOST
