"""EngineConfig.l2_prefetch's wiring (engine/l2_prefetcher.py): at decode-sized steps every
attention layer asks for its own o_proj weight, and the offloaded device path for the rows the
fill plan chose (the rows its MoE kernels then read); prefill chunks and engines without the
option ask for nothing; the tokens stay the same. On the CPU the dispatchers do nothing, so
spies see what a GPU would be asked for."""

from __future__ import annotations

import random

import pytest
from tiny_models import make_tiny

from freetoken_agent import Engine, SamplingParams
from freetoken_agent.engine.experts import device_path
from freetoken_agent.engine.l2_prefetcher import MOE_ROW_FRACTION, PREFETCH_ROWS
from freetoken_agent.engine.layers import attention
from freetoken_agent.engine.layers.attention import SelfAttention


@pytest.mark.parametrize("policy", ["resident", "gpu-fill"])
def test_decode_steps_ask_for_what_their_next_kernels_read(policy, tmp_path, rng_seed,
                                                           monkeypatch):  # fmt: skip
    make_tiny("qwen3_moe", tmp_path, rng_seed)
    rng = random.Random(rng_seed)
    asked, rows_asked, moe_rows = [], [], []
    real_rows = device_path.fused_moe
    monkeypatch.setattr(attention, "prefetch_tensor", lambda t: asked.append(t))
    monkeypatch.setattr(device_path, "prefetch_rows",
                        lambda bank, rows, f: rows_asked.append((bank, rows, f)))  # fmt: skip

    def moe(hidden, w13, w2, rows, *args, **kwargs):
        moe_rows.append(rows)
        return real_rows(hidden, w13, w2, rows, *args, **kwargs)

    monkeypatch.setattr(device_path, "fused_moe", moe)
    load = {} if policy == "resident" else {"expert_slots": rng.randint(3, 12)}
    prompt = [rng.randrange(3, 320) for _ in range(rng.randint(PREFETCH_ROWS + 1, 40))]
    sp = SamplingParams(max_tokens=rng.randint(3, 8), temperature=0, ignore_eos=True)
    runs = {}
    for on in (False, True):
        asked.clear(), rows_asked.clear(), moe_rows.clear()
        engine = Engine.load(tmp_path, device="cpu", policy=policy, progress=False,
                             l2_prefetch=on, **load)  # fmt: skip
        runs[on] = engine.generate([prompt], sp)[0].token_ids
        if not on:
            assert asked == [] and rows_asked == []
            continue
        weights = [m.o_proj.weight for m in engine.loaded.model.modules()
                   if isinstance(m, SelfAttention)]  # fmt: skip
        steps = sp.max_tokens - 1  # decode steps of one token; the prompt's chunk asks nothing
        assert len(asked) == steps * len(weights)
        for i, t in enumerate(asked):
            assert t is weights[i % len(weights)]  # each layer its own, in layer order
        if policy == "gpu-fill":
            assert len(rows_asked) == len(moe_rows) >= steps * engine.spec.n_moe_layers
            for (bank, rows, fraction), used in zip(rows_asked, moe_rows, strict=True):
                assert bank is engine.loaded.bank.cache.w13 and fraction == MOE_ROW_FRACTION
                assert rows.data_ptr() == used.data_ptr()  # the rows the MoE kernels read
        else:
            assert rows_asked == []
    assert runs[True] == runs[False]
