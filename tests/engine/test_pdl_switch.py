"""FREETOKEN_PDL is checked when an engine loads (kernels/pdl_switch.py): a misspelt value
fails there, naming the variable and the word, and not at the first CUDA step."""

from __future__ import annotations

import random

import pytest
from tiny_models import make_tiny

from freetoken_agent import Engine


def test_a_misspelt_value_fails_at_load(tmp_path, rng_seed, monkeypatch):
    make_tiny("qwen3_moe", tmp_path, rng_seed)
    word = random.Random(rng_seed).choice(["sometimes", "yes", "on,eventually", "prefech"])
    monkeypatch.setenv("FREETOKEN_PDL", word)
    with pytest.raises(ValueError, match=r"FREETOKEN_PDL: unknown"):
        Engine.load(tmp_path, device="cpu", progress=False)
    monkeypatch.setenv("FREETOKEN_PDL", "light,prefetch")  # a good one loads (no CUDA: no PDL)
    Engine.load(tmp_path, device="cpu", progress=False)
