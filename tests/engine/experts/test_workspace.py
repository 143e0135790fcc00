"""The workspace slots are sized beside is the one the bank's prefill uses: an offloaded bank
runs the fused MoE in STREAMED_MOE_PAIRS chunks (its workspace is smaller), and an `adaptive`
budget that fits every expert only beside that smaller workspace keeps the experts offloaded
(a resident bank would run larger chunks and overrun the budget)."""

from __future__ import annotations

import gc
import random
from dataclasses import replace

import pytest
import torch
from tiny_models import make_tiny, tiny_config

from freetoken_agent import Engine, SamplingParams
from freetoken_agent.engine.config import EngineConfig
from freetoken_agent.engine.experts import offload, streaming
from freetoken_agent.engine.experts.offload import OffloadedExpertBank
from freetoken_agent.engine.experts.placement import make_bank, slot_count, workspace_bytes
from freetoken_agent.engine.experts.resident import ResidentExpertBank
from freetoken_agent.engine.experts.streaming import STREAMED_MOE_PAIRS
from freetoken_agent.engine.models.registry import spec_from_config
from freetoken_agent.kernels.fused_moe import PATH_LIMITS


def test_offloaded_prefill_runs_in_the_chunk_its_workspace_was_sized_for(
    tmp_path, rng_seed, monkeypatch
):
    make_tiny("qwen3_moe", tmp_path, rng_seed)
    chunks: list[int | None] = []
    kernel = offload.fused_moe

    def recording(hidden, w13, w2, ids, weights, *args, **kwargs):
        if ids.numel() > PATH_LIMITS["decode_max_pairs"]:  # a prefill-path call
            chunks.append(kwargs.get("max_pairs"))
        return kernel(hidden, w13, w2, ids, weights, *args, **kwargs)

    monkeypatch.setattr(offload, "fused_moe", recording)  # placed chunks

    class RecordingParts(streaming.MoeParts):  # streamed ones
        def __init__(self, hidden, topk_ids, *args, **kwargs):
            chunks.append(args[-1])  # max_pairs
            super().__init__(hidden, topk_ids, *args, **kwargs)

    monkeypatch.setattr(streaming, "MoeParts", RecordingParts)
    rng = random.Random(rng_seed)
    # One prompt streams (>= stream_min_tokens), one fills slots expert by expert.
    prompts = [[rng.randrange(3, 320) for _ in range(n)] for n in (rng.randint(130, 200), 90)]
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    opts = dict(device="cpu", progress=False, max_model_len=512)
    resident = Engine.load(tmp_path, policy="resident", **opts)
    for policy in ("transfer", "adaptive"):
        engine = Engine.load(tmp_path, policy=policy, expert_slots=6, stream_min_tokens=128, **opts)
        chunks.clear()
        got = [o.token_ids for o in engine.generate(prompts, sp)]
        assert got == [o.token_ids for o in resident.generate(prompts, sp)], policy
        assert engine.stats()["experts"]["layers_streamed"] > 0
        assert chunks and set(chunks) == {STREAMED_MOE_PAIRS}, (policy, chunks)


def _budget_around_all_fitting(spec, config: EngineConfig, dtype: torch.dtype) -> tuple[int, int]:
    """(the least budget at which every expert fits beside an offloaded bank's workspace,
    the least beside a resident bank's): found by bisection on slot_count itself."""
    rows = spec.n_moe_layers * spec.n_experts
    dev = torch.device("cpu")

    def least(offloaded: bool) -> int:
        lo, hi = 1, 1 << 40
        while lo < hi:
            mid = (lo + hi) // 2
            cfg = replace(config, gpu_budget=mid)
            try:
                fits = slot_count(spec, cfg, dev, dtype, 0, offloaded=offloaded) >= rows
            except ValueError:  # BudgetError: not one slot
                fits = False
            lo, hi = (lo, mid) if fits else (mid + 1, hi)
        return lo

    return least(True), least(False)


def test_adaptive_keeps_experts_offloaded_when_only_the_smaller_workspace_fits(rng_seed):
    rng = random.Random(rng_seed)
    spec = spec_from_config(tiny_config("qwen3_moe").to_dict())
    k = spec.top_k
    # A chunk long enough that the resident bank's prefill buffers exceed the streamed chunk's.
    tokens = rng.randint(STREAMED_MOE_PAIRS // k + 1, 4 * STREAMED_MOE_PAIRS // k)
    base = EngineConfig(max_batched_tokens=tokens, kv_tokens=rng.randint(64, 4096))
    dtype = torch.float32
    assert workspace_bytes(spec, base, offloaded=True) < workspace_bytes(
        spec, base, offloaded=False
    )
    offloaded_fit, resident_fit = _budget_around_all_fitting(spec, base, dtype)
    assert offloaded_fit < resident_fit
    for budget, want in (
        (rng.randrange(offloaded_fit, resident_fit), OffloadedExpertBank),
        (resident_fit + rng.randrange(0, 1 << 20), ResidentExpertBank),
    ):
        cfg = replace(base, gpu_budget=budget, policy="adaptive")
        bank = make_bank(spec, cfg, torch.device("cpu"), dtype, 0)
        assert isinstance(bank, want), (budget, offloaded_fit, resident_fit)
        if want is OffloadedExpertBank:  # every expert in a slot, none on the CPU
            assert bank.cache.n_slots == spec.n_moe_layers * spec.n_experts


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["resident", "transfer"])
def test_prefill_peak_stays_within_the_workspace_estimate_on_cuda(policy, rng_seed):
    """Real shapes (hidden 2048, 128 experts of width 768, top-8), two layers, an 8192-token
    chunk: torch's peak allocation during the prefill step is below the estimate."""
    from freetoken_agent.bench.random_model import QWEN3_30B_A3B, random_engine

    cfg = {**QWEN3_30B_A3B, "num_hidden_layers": 2, "vocab_size": 4096}
    n = 8192
    options = dict(kv_tokens=n + 64, max_batched_tokens=n, max_model_len=n + 64, max_num_seqs=2)
    if policy != "resident":
        options.update(expert_slots=64, stream_min_tokens=512)
    engine = random_engine(cfg, policy=policy, seed=rng_seed, **options)
    try:
        rng = random.Random(rng_seed)
        sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        engine.generate([rng.randrange(4096) for _ in range(n)], sp)  # compiles the kernels
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        engine.generate([rng.randrange(4096) for _ in range(n)], sp)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        offloaded = policy != "resident"
        estimate = workspace_bytes(engine.spec, engine.loaded.config, offloaded=offloaded)
        print(f"{policy}: peak {peak / 1e9:.3f} GB, estimate {estimate / 1e9:.3f} GB")
        assert 0 < peak <= estimate
    finally:
        # Later tests read the driver's free memory: give back what this engine cached.
        engine.close()
        del engine
        gc.collect()
        torch.cuda.empty_cache()
