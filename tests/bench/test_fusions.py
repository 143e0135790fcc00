"""bench fusions' switch: each variant sets exactly its fusions and skinny matmuls on the model,
and back."""

from __future__ import annotations

import random

from tiny_models import make_tiny

from freetoken_agent import Engine
from freetoken_agent.bench.fusions import VARIANTS, set_variant
from freetoken_agent.engine.layers.attention import SelfAttention
from freetoken_agent.engine.layers.moe import TopKRouter
from freetoken_agent.engine.models.base import DecoderLayer
from freetoken_agent.kernels.triton import pdl


def test_each_variant_sets_its_fusions_and_recaptures(tmp_path, rng_seed, monkeypatch):
    make_tiny("qwen3_moe", tmp_path, rng_seed)
    engine = Engine.load(tmp_path, device="cpu", progress=False)
    captured = []
    monkeypatch.setattr(engine, "capture_graphs", lambda: captured.append(True))
    model = engine.loaded.model
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    layers = [m for m in model.modules() if isinstance(m, DecoderLayer)]
    projections = [m for m in model.modules() if hasattr(m, "skinny")]
    attention = [m for m in model.modules() if isinstance(m, SelfAttention)]
    assert projections
    for name in [*random.sample(list(VARIANTS), len(VARIANTS)), "none"]:
        set_variant(engine, name)
        router, proj_norm, pdl_word, skinny, l2, norm_qkv = VARIANTS[name]
        assert all(m.fused == router for m in routers), name
        assert all(m.fused_proj_norm == proj_norm for m in layers), name
        assert all(m.fused_norm_qkv == (norm_qkv is True) for m in layers), name
        assert all(m.attention_block == (norm_qkv == "block") for m in layers), name
        assert all(m.skinny == skinny for m in projections), name
        assert all((m.l2 is not None) == l2 for m in attention), name
        pdl.flags(pdl_word)  # a word the switch takes
    assert len(captured) == len(VARIANTS) + 1
