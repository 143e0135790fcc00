"""RecurrentShadow: the recurrent layers of re-run segments go back to the step's start state,
the others keep what they computed (segmented decode running ahead on hybrid models)."""

from __future__ import annotations

import dataclasses
import functools
import random

import torch
from tiny_models import tiny_config

from freetoken_agent.engine.models.registry import spec_from_config
from freetoken_agent.engine.recurrent_shadow import RecurrentShadow


def _random_layout(rng: random.Random):
    """A hybrid spec with random mixers and a random subset of MoE layers (dense MLPs between)."""
    spec = spec_from_config(tiny_config("qwen3_5_moe").to_dict())
    n = rng.randint(4, 14)
    types = [rng.choice(("linear_attention", "full_attention")) for _ in range(n)]
    types[rng.randrange(n)] = "linear_attention"
    moe = tuple(sorted(rng.sample(range(n), rng.randint(1, n))))
    return dataclasses.replace(spec, n_layers=n, layer_types=tuple(types), moe_layers=moe)


def test_layers_of_segments_follow_the_moe_layers_before_each_mixer(rng_seed):
    rng = random.Random(rng_seed)
    for _ in range(30):
        spec = _random_layout(rng)
        rec = spec.recurrent_layers
        shadow = RecurrentShadow(spec, torch.zeros(len(rec), 1, 1), torch.zeros(len(rec), 1, 1))
        n_segments = spec.n_moe_layers + 1
        for a in range(n_segments + 1):
            for b in range(a, n_segments + 1):
                # Mixer of decoder layer d runs in segment #(MoE layers before d).
                want = [
                    r for r, d in enumerate(rec) if a <= sum(m < d for m in spec.moe_layers) < b
                ]
                assert list(shadow.layers_of(a, b)) == want, (spec.moe_layers, rec, a, b)


def test_restore_puts_back_the_rerun_layers_rows_only(rng_seed):
    rng = random.Random(rng_seed)
    g = torch.Generator().manual_seed(rng_seed)
    spec = _random_layout(rng)
    n_rec, n_slots = len(spec.recurrent_layers), rng.randint(3, 9)
    conv = torch.randn(n_rec, n_slots, 3, 2, generator=g)
    ssm = torch.randn(n_rec, n_slots, 2, 3, 3, generator=g)
    shadow = RecurrentShadow(spec, conv, ssm)
    live = rng.sample(range(1, n_slots), rng.randint(1, n_slots - 1))
    slots = torch.tensor(live + [0] * rng.randint(0, 2))  # padding rows: the scratch slot 0
    start = (conv.clone(), ssm.clone())
    shadow.save(slots)
    conv.add_(torch.randn(conv.shape, generator=g))  # the step (and what ran ahead) moved on
    ssm.add_(torch.randn(ssm.shape, generator=g))
    moved = (conv.clone(), ssm.clone())
    n_segments = spec.n_moe_layers + 1
    a = shadow.segment_of[rng.randrange(n_rec)]  # a range holding at least one layer
    b = rng.randint(a + 1, n_segments)
    shadow.restore(a, b)
    back = set(shadow.layers_of(a, b))
    assert back
    for now, before, after in zip((conv, ssm), start, moved, strict=True):
        for r in range(n_rec):
            for s in range(n_slots):
                want = before if (r in back and s in live) else after
                if s == 0 and r in back:
                    continue  # scratch: padding rows read and write it, its value is no one's
                assert torch.equal(now[r, s], want[r, s]), (r, s, sorted(back))


def test_workspace_counts_the_shadow_when_hybrid_runs_ahead(rng_seed):
    from freetoken_agent.engine.config import EngineConfig
    from freetoken_agent.engine.experts.placement import workspace_bytes
    from freetoken_agent.engine.kv.recurrent_state import state_bytes

    seqs = random.Random(rng_seed).randint(1, 16)
    hybrid = spec_from_config(tiny_config("qwen3_5_moe").to_dict())
    plain = spec_from_config(tiny_config("qwen3_moe").to_dict())
    on, off = (
        EngineConfig(max_num_seqs=seqs, hybrid_run_ahead=True),
        EngineConfig(max_num_seqs=seqs),
    )
    lin = hybrid.linear
    row = state_bytes(len(hybrid.recurrent_layers), lin.conv_state_shape, lin.ssm_state_shape,
                      hybrid.dtype)  # fmt: skip
    for offloaded in (True, False):
        ws = functools.partial(workspace_bytes, offloaded=offloaded)
        assert ws(hybrid, on) - ws(hybrid, off) == seqs * row > 0
        assert ws(plain, on) == ws(plain, off)
