"""A decode-graph capture the driver invalidates is retried once, then decode runs without
graphs: the engine keeps serving, says why in its stats, and its tokens do not change. (On the
CPU the capture itself is replaced by a stand-in that fails as the device's did.)"""

from __future__ import annotations

import logging
import random

import pytest
from tiny_models import make_tiny

from freetoken_agent import Engine, SamplingParams
from freetoken_agent.engine.graph_capture import CAPTURE_ATTEMPTS


@pytest.fixture
def engine(tmp_path, rng_seed):
    make_tiny("qwen2_moe", tmp_path, rng_seed)
    return Engine.load(tmp_path, device="cpu", progress=False, kv_tokens=2048, max_model_len=256)


class FlakyCapture:
    """enable_cuda_graphs failing its first `fails` calls, then installing `graphs`."""

    def __init__(self, runner, fails: int, graphs=None) -> None:
        self.runner, self.fails, self.graphs, self.calls = runner, fails, graphs, 0

    def __call__(self, max_batch, max_pages, offloaded=None, states=None) -> None:
        self.calls += 1
        self.runner.graphs = object()  # a half-built capture the engine must drop
        if self.calls <= self.fails:
            raise RuntimeError(
                "CUDA error: operation failed due to a previous error during capture\nmore"
            )
        self.runner.graphs = self.graphs


def test_capture_retried_once_then_decode_without_graphs(engine, rng_seed, caplog):
    rng = random.Random(rng_seed)
    prompt = [rng.randrange(3, 300) for _ in range(rng.randint(5, 40))]
    sp = SamplingParams(max_tokens=rng.randint(4, 12), temperature=0, ignore_eos=True)
    want = engine.generate(prompt, sp).token_ids
    flaky = FlakyCapture(engine.runner, fails=CAPTURE_ATTEMPTS)
    engine.runner.enable_cuda_graphs = flaky
    with caplog.at_level(logging.WARNING, logger="freetoken.engine"):
        engine.capture_graphs()
    assert flaky.calls == CAPTURE_ATTEMPTS
    assert engine.runner.graphs is None  # no half-built graphs left to replay
    stats = engine.stats()
    assert stats["cuda_graphs"] is False
    assert stats["graph_error"] == (
        "RuntimeError: CUDA error: operation failed due to a previous error during capture"
    )
    assert "decoding without CUDA graphs" in caplog.text
    assert engine.generate(prompt[::-1], sp).finish_reason == "length"  # it still serves
    assert engine.generate(prompt, sp).token_ids == want  # and the same tokens


def test_capture_that_passes_on_retry_keeps_graphs(engine):
    captured = object()  # stands for the graphs the second capture built
    flaky = FlakyCapture(engine.runner, fails=1, graphs=captured)
    engine.runner.enable_cuda_graphs = flaky
    engine.capture_graphs()
    assert flaky.calls == 2 and engine.runner.graphs is captured
    assert engine.stats()["cuda_graphs"] is True and engine.graph_error is None
