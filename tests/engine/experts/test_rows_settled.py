"""Which MoE calls say their rows are settled (kernels/triton/pdl.py's `prefetch`: gate/up then
reads its rows before it waits for the kernel before it). Only the device path's, whose rows
the fill plan wrote with the copy kernel between: anywhere else the rows come from the kernel
just before, and a read before the wait could see them half written."""

from __future__ import annotations

import random

import pytest
from tiny_models import make_tiny

from freetoken_agent import Engine, SamplingParams
from freetoken_agent.engine.experts import device_path, graph_decode, offload, resident
from freetoken_agent.kernels import fused_moe as fused_moe_module


@pytest.mark.parametrize("policy", ["gpu-fill", "transfer", "adaptive", "resident"])
def test_only_the_device_path_says_its_rows_are_settled(policy, tmp_path, rng_seed, monkeypatch):
    make_tiny("qwen3_moe", tmp_path, rng_seed)
    rng = random.Random(rng_seed)
    calls: list[tuple[str, bool]] = []
    real = fused_moe_module.fused_moe

    def spy(where):
        def call(*args, **kwargs):
            calls.append((where, kwargs.get("rows_settled", False)))
            return real(*args, **kwargs)

        return call

    for module in (device_path, graph_decode, offload, resident):
        if hasattr(module, "fused_moe"):
            monkeypatch.setattr(module, "fused_moe", spy(module.__name__.rsplit(".", 1)[-1]))
    # 2 MoE layers x 8 experts: fewer slots keep the bank offloaded
    load = {} if policy == "resident" else {"expert_slots": rng.randint(3, 12)}
    engine = Engine.load(tmp_path, device="cpu", policy=policy, progress=False, **load)
    prompt = [rng.randrange(3, 320) for _ in range(rng.randint(2, 20))]
    engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert calls, policy
    settled = {where for where, said in calls if said}
    assert settled <= {"device_path"}, calls
    if policy == "gpu-fill":  # every decode layer plans and copies its fills
        assert ("device_path", True) in calls
        assert all(said for where, said in calls if where == "device_path")
