"""Engine.close gives the engine's memory back at once and refuses later calls clearly."""

from __future__ import annotations

import gc
import random
import weakref

import pytest
import torch
from tiny_models import make_tiny

from freetoken_agent.engine.engine import Engine
from freetoken_agent.engine.outputs import EngineClosedError
from freetoken_agent.engine.sampling_params import SamplingParams

SP = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("policy", ["resident", "transfer"])
def test_close_drops_what_holds_memory_and_refuses_later_calls(tmp_path, rng_seed, policy):
    make_tiny("qwen3_moe", tmp_path, rng_seed)
    rng = random.Random(rng_seed)
    slots = {} if policy == "resident" else {"expert_slots": rng.randint(1, 6)}
    engine = Engine.load(tmp_path, device="cpu", progress=False, policy=policy, **slots)
    prompt = [rng.randrange(3, 320) for _ in range(rng.randint(5, 40))]
    assert len(engine.generate(prompt, SP).token_ids) == SP.max_tokens
    pending = engine.submit([rng.randrange(3, 320) for _ in range(9)], SP)
    engine.step()  # a request left unfinished
    loaded = engine.loaded
    held = [weakref.ref(x) for x in (loaded.model, loaded.kv, loaded.bank)]
    del loaded
    gc.disable()  # the collection must be close's own
    try:
        engine.close()
        assert [r() for r in held] == [None] * len(held), "something still holds the memory"
    finally:
        gc.enable()
    assert engine._requests[pending].finish_reason == "abort"
    for call in (lambda: engine.submit(prompt, SP), engine.step, engine.stats,
                 lambda: engine.generate(prompt, SP), engine.poll_memory):  # fmt: skip
        with pytest.raises(EngineClosedError, match="closed"):
            call()
    assert not engine.has_unfinished()
    engine.close()  # twice: nothing


@pytest.mark.gpu
def test_cuda_close_returns_device_memory_and_the_pins(tmp_path, rng_seed):
    """On CUDA: the arena's mapped chunks, the KV, the slots and the graphs go back to the
    driver at close (free memory as before the load, within what torch and the libraries keep),
    and the pool's registration is released; a second engine then loads with the same budget."""
    over = dict(hidden_size=256, moe_intermediate_size=1024, num_experts=32)
    make_tiny("qwen3_moe", tmp_path, rng_seed, max_position_embeddings=2048, **over)
    opts = dict(device="cuda", progress=False, max_model_len=1024, policy="transfer")
    warm = Engine.load(tmp_path, **opts)  # the context, cuBLAS and Triton's modules load once
    warm.close()
    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info()[0]
    engine = Engine.load(tmp_path, **opts)
    prompt = [random.Random(rng_seed).randrange(3, 320) for _ in range(50)]
    want = engine.generate(prompt, SP).token_ids
    took = free0 - torch.cuda.mem_get_info()[0]
    assert took > 64 << 20, took  # the engine held something worth giving back
    pool = weakref.ref(engine.loaded.bank.pool)
    engine.close()
    assert pool() is None
    assert torch.cuda.mem_get_info()[0] >= free0 - (32 << 20)
    again = Engine.load(tmp_path, **opts)
    assert again.generate(prompt, SP).token_ids == want
    again.close()
