"""FTW conversion: the banks hold every expert at its lid, loading FTW equals loading HF, and
damaged FTW folders are refused with an error that names the damage."""

from __future__ import annotations

import json
import random

import pytest
import torch
from tiny_models import FAMILIES, HYBRID_FAMILIES, make_tiny

from freetoken_agent import Engine
from freetoken_agent.engine.config import read_config
from freetoken_agent.engine.models.registry import spec_from_config
from freetoken_agent.engine.weights import ftw
from freetoken_agent.engine.weights.loader import CheckpointError


@pytest.mark.parametrize("family", (*FAMILIES, *HYBRID_FAMILIES))
def test_ftw_loads_identically(family, tmp_path, rng_seed):
    hf_dir, ftw_dir = tmp_path / "hf", tmp_path / "ftw"
    hf = make_tiny(family, hf_dir, rng_seed)
    ftw.convert(hf_dir, ftw_dir, progress=False)
    spec = spec_from_config(read_config(ftw_dir))
    ftw.verify(ftw_dir, spec)
    banks = ftw.open_banks(ftw_dir, spec)
    # Spot-check a random expert against transformers' own weights.
    moe_layer = random.Random(rng_seed).choice(spec.moe_layers)
    expert = random.Random(rng_seed + 1).randrange(spec.n_experts)
    lid = spec.moe_index(moe_layer) * spec.n_experts + expert
    experts = hf.model.layers[moe_layer].mlp.experts  # transformers 5: fused 3-D parameters
    assert torch.equal(banks["w13"][lid], experts.gate_up_proj[expert].detach())
    assert torch.equal(banks["w2"][lid], experts.down_proj[expert].detach())
    a = Engine.load(hf_dir, device="cpu", progress=False, kv_tokens=1024)
    b = Engine.load(ftw_dir, device="cpu", progress=False, kv_tokens=1024)
    ids = [random.Random(rng_seed).randrange(3, 320) for _ in range(50)]
    assert torch.equal(a.score(ids), b.score(ids))


def test_damaged_ftw_is_refused(tmp_path, rng_seed):
    hf_dir, ftw_dir = tmp_path / "hf", tmp_path / "ftw"
    make_tiny("qwen3_moe", hf_dir, rng_seed)
    ftw.convert(hf_dir, ftw_dir, progress=False)
    spec = spec_from_config(read_config(ftw_dir))
    bank = ftw_dir / "experts.w2.bin"
    raw = bytearray(bank.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    bank.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="w2: 1 expert rows fail their checksum"):
        ftw.verify(ftw_dir, spec)
    bank.write_bytes(bytes(raw[:-2]))
    with pytest.raises(CheckpointError, match="experts.w2.bin should hold"):
        Engine.load(ftw_dir, device="cpu", progress=False)
    manifest = json.loads((ftw_dir / "ftw.json").read_text())
    manifest["version"] = 99
    (ftw_dir / "ftw.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="version 99"):
        Engine.load(ftw_dir, device="cpu", progress=False)
    with pytest.raises(FileExistsError):
        ftw.convert(hf_dir, ftw_dir, progress=False)
