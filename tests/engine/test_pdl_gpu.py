"""Programmatic dependent launch on CUDA (device machine): an engine whose decode kernels launch
with PDL, in its captured graphs and eagerly, gives the tokens and the logits of one without,
bit for bit. PDL moves when a kernel's programs start, never what they compute; a kernel that
read its predecessor's output before that finished would show here as changed bits or tokens."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import make_tiny

from freetoken_agent import Engine, SamplingParams
from freetoken_agent.kernels.triton import pdl

pytestmark = pytest.mark.gpu


def _run(tmp_path, word: str, prompts, sp, **load):
    """Tokens of the prompts together and of the first alone, and the logits of a scored
    sequence, with PDL as FREETOKEN_PDL=`word` for everything the engine launches (its graphs
    included)."""
    with pdl.override(word):
        # sm_90 (the H200) supports PDL: a kernel that asks for the prefetch gets every flag
        # of the word but LIGHT, which only decides whether heavy kernels launch early.
        asked = pdl.launch(torch.device("cuda"), prefetch=True)["PDL"]
        assert asked == pdl.flags(word) & ~pdl.LIGHT, (word, asked)
        engine = Engine.load(tmp_path, device="cuda", progress=False, max_model_len=512,
                             max_num_seqs=4, **load)  # fmt: skip
        if load.get("policy") == "adaptive":  # its three paths in turn, the shared one too
            engine.loaded.bank.adaptive.path_params = dict(block=2, rotations=1, period=0, warm=0)
            engine.loaded.bank.adaptive.shared_gate = False
        together = [o.token_ids for o in engine.generate(prompts, sp)]
        alone = engine.generate(prompts[:1], sp)[0].token_ids
        logits = engine.score(prompts[1] + together[1])
        engine.check_integrity()
        engine.close()
    return together, alone, logits


@pytest.mark.parametrize(
    "policy,dtype,word,skinny",
    [
        ("resident", torch.bfloat16, "on", False),
        ("resident", torch.bfloat16, "exit,prefetch", True),  # the skinny matmul prefetches
        ("gpu-fill", torch.bfloat16, "prefetch", True),
        ("gpu-fill", torch.bfloat16, "light", False),
        ("adaptive", torch.float32, "on", False),
    ],
)
def test_pdl_changes_no_bit(policy, dtype, word, skinny, tmp_path, rng_seed):
    make_tiny("qwen3_moe", tmp_path, rng_seed, dtype=dtype, num_experts=16,
              num_experts_per_tok=4)  # fmt: skip
    rng = random.Random(rng_seed)
    prompts = [[rng.randrange(3, 320) for _ in range(rng.randint(1, 12))],
               [rng.randrange(3, 320) for _ in range(rng.randint(30, 90))]]  # fmt: skip
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    load = {"policy": policy, "skinny_gemv": skinny}
    if policy != "resident":  # fewer slots than the 3 layers x 16 experts: misses each step
        load["expert_slots"] = rng.randint(12, 30)
    off = _run(tmp_path, "off", prompts, sp, **load)
    on = _run(tmp_path, word, prompts, sp, **load)
    assert on[0] == off[0] and on[1] == off[1], (policy, word)
    if policy == "adaptive":  # where the CPU ran a miss is timing: tokens only (its own tests)
        return
    assert torch.equal(on[2], off[2]), (on[2] - off[2]).abs().max()


@pytest.mark.parametrize("policy", ["resident", "gpu-fill"])
def test_l2_prefetch_changes_no_bit(policy, tmp_path, rng_seed):
    """EngineConfig.l2_prefetch's side-stream prefetches (o_proj; the device path's MoE rows),
    forked and joined inside the captured graphs: the same tokens and logits, bit for bit."""
    make_tiny("qwen3_moe", tmp_path, rng_seed, dtype=torch.bfloat16, num_experts=16,
              num_experts_per_tok=4)  # fmt: skip
    rng = random.Random(rng_seed)
    prompts = [[rng.randrange(3, 320) for _ in range(rng.randint(1, 12))],
               [rng.randrange(3, 320) for _ in range(rng.randint(30, 90))]]  # fmt: skip
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    load = {"policy": policy}
    if policy != "resident":
        load["expert_slots"] = rng.randint(12, 30)
    off = _run(tmp_path, "off", prompts, sp, **load)
    on = _run(tmp_path, "off", prompts, sp, l2_prefetch=True, **load)
    assert on[0] == off[0] and on[1] == off[1], policy
    assert torch.equal(on[2], off[2]), (on[2] - off[2]).abs().max()
