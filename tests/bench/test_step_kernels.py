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
