"""Fill-through on the device path (EngineConfig.fill_through): the MoE kernels store each
moved expert into its slot as they read it from the pool, with no copy kernel before them.
An engine with it gives the resident engine's tokens and logits, and its slots hold exactly
their experts' weights afterwards."""

import random

import pytest
import torch
from tiny_models import make_tiny

from freetoken_agent import Engine, SamplingParams
from freetoken_agent.engine.experts import device_path


def _slots_hold_their_experts(engine) -> int:
    """Every resident lid's slot equals its pool rows (both banks); returns how many."""
    cache = engine.loaded.bank.cache
    cache.check_integrity()  # the mirror rebuilt from the device tables
    n = 0
    for lid, slot in enumerate(cache.host_slot_of):
        if slot >= 0:
            assert torch.equal(cache.w13[slot].cpu(), cache.pool.w13[lid]), (lid, slot)
            assert torch.equal(cache.w2[slot].cpu(), cache.pool.w2[lid]), (lid, slot)
            n += 1
    return n


def _check(tmp_path, rng_seed, monkeypatch, device: str, policy: str, dtype=torch.float32):
    make_tiny("qwen3_moe", tmp_path, rng_seed, dtype=dtype, num_experts=16,
              num_experts_per_tok=4)  # fmt: skip
    rng = random.Random(rng_seed)
    prompts = [[rng.randrange(3, 320) for _ in range(n)] for n in (6, 35)]
    sp = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    opts = dict(device=device, progress=False, max_model_len=512, max_num_seqs=4)
    resident = Engine.load(tmp_path, policy="resident", **opts)
    want = [o.token_ids for o in resident.generate(prompts, sp)]
    slots = rng.randint(8, 30)  # of 3 layers x 16 experts: misses every step
    # Each device-path layer's MoE call: (filled through, the graph held adaptive's CPU
    # worker then: the MoE sum collects its answer); the copy kernels' calls counted. Without
    # the worker: fill-through and no copy kernel; with it, a copy kernel beside the worker.
    moes: list[tuple[bool, bool]] = []
    copies: list[int] = []
    # The spies go in before the engine loads: on CUDA it captures its decode graphs there,
    # and a replay calls no Python (the spies see the calls made while capturing).
    copy, moe = device_path.copy_fills, device_path.fused_moe

    def counted_copy(*args, **kw):
        copies.append(1)
        return copy(*args, **kw)

    def counted_moe(*args, **kw):
        moes.append((kw.get("fill_slot_of") is not None, kw.get("collect") is not None))
        return moe(*args, **kw)

    monkeypatch.setattr(device_path, "copy_fills", counted_copy)
    monkeypatch.setattr(device_path, "fused_moe", counted_moe)
    engine = Engine.load(tmp_path, policy=policy, expert_slots=slots, fill_through=True, **opts)
    assert [o.token_ids for o in engine.generate(prompts, sp)] == want
    assert moes, "no step took the device path"
    assert all(through == (not worker) for through, worker in moes), moes
    assert len(copies) == sum(worker for _, worker in moes), "a copy kernel without the worker"
    if policy == "gpu-fill":
        assert not copies and all(through for through, _ in moes)
    assert engine.generate(prompts[:1], sp)[0].token_ids == want[0]
    ids = prompts[1] + want[1]
    torch.testing.assert_close(engine.score(ids), resident.score(ids), atol=3e-5, rtol=3e-5)
    st = engine.stats()["experts"]
    assert st["fetched"] > 0, "nothing was filled"
    assert _slots_hold_their_experts(engine) > 0


@pytest.mark.parametrize("policy", ["gpu-fill", "adaptive"])
def test_fill_through_gives_the_resident_tokens(policy, tmp_path, rng_seed, monkeypatch):
    _check(tmp_path, rng_seed, monkeypatch, "cpu", policy)


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["gpu-fill", "adaptive"])
def test_fill_through_on_cuda_under_graphs(policy, tmp_path, rng_seed, monkeypatch):
    """CUDA (device machine): the Triton plan keeps moved lids' host ids and the decode
    kernels store them into their slots, inside the captured whole-step graphs (the spies see
    the calls made while capturing and eagerly)."""
    _check(tmp_path, rng_seed, monkeypatch, "cuda", policy)
