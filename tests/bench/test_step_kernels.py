"""bench step-kernels' table: device time and launches a step, per kernel and per MoE layer."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from freetoken_agent.bench.step_kernels import kernel_rows


def _event(key: str, device_type: str, us: float, count: int):
    return SimpleNamespace(
        key=key,
        device_type=SimpleNamespace(name=device_type),
        self_device_time_total=us,
        count=count,
    )


def test_kernel_rows_divide_by_steps_and_layers_and_skip_host_events(rng_seed):
    rng = random.Random(rng_seed)
    steps, layers = rng.randrange(2, 20), rng.randrange(1, 48)
    kernels = {f"k{i}": (rng.uniform(1, 500) * steps, rng.randrange(1, 4) * steps)
               for i in range(rng.randrange(2, 9))}  # fmt: skip
    events = [_event(k, "CUDA", us, n) for k, (us, n) in kernels.items()]
    events += [_event("cudaGraphLaunch", "CPU", 1e6, steps), _event("idle", "CUDA", 0.0, 3)]
    rng.shuffle(events)
    total, rows = kernel_rows(events, steps, layers)
    assert total == pytest.approx(sum(us for us, _ in kernels.values()) / steps)
    assert [r["kernel"] for r in rows] == sorted(kernels, key=lambda k: -kernels[k][0])
    for r in rows:
        us, n = kernels[r["kernel"]]
        assert r["us_per_step"] == pytest.approx(us / steps, abs=0.01)
        assert r["launches_per_step"] == pytest.approx(n / steps, abs=0.01)
        assert r["us_per_layer"] == pytest.approx(us / steps / layers, abs=1e-3)


def test_release_callers_counts_hand_backs_by_caller_and_restores_release(tmp_path, rng_seed):
    """An engine under gpu-fill on the CPU: a step owns the cache, a host read of the mirror
    (here `check_integrity` through `resident`) hands it back; the counter names that caller,
    counts only hand-backs of an owned cache, and `release` is itself again after."""
    from tiny_models import make_tiny

    from freetoken_agent import Engine, SamplingParams
    from freetoken_agent.bench.step_kernels import release_callers
    from freetoken_agent.engine.experts.device_fills import DeviceFills

    make_tiny("qwen3_moe", tmp_path, rng_seed, num_experts=16, num_experts_per_tok=4)
    engine = Engine.load(tmp_path, device="cpu", policy="gpu-fill", expert_slots=6,
                         progress=False)  # fmt: skip
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    release = DeviceFills.release
    engine.generate([5, 6, 7], sp)
    fills = engine.loaded.bank.cache.on_device
    with release_callers() as callers:
        fills.own()
        engine.loaded.bank.cache.resident(0)  # reads the mirror: a hand-back
        engine.loaded.bank.cache.resident(1)  # not owned any more: nothing to count
    assert DeviceFills.release is release
    assert dict(callers) == {
        "test_step_kernels.py:"
        + test_release_callers_counts_hand_backs_by_caller_and_restores_release.__name__: 1
    }  # noqa: E501
