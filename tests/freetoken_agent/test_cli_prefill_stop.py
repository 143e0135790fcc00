"""Ctrl-C during a long prompt's prefill (`freetoken chat` / `generate`): the stream is asked
before each engine step, so the reply stops after the prefill chunk running (it waited for the
whole prompt, and a second Ctrl-C ended the chat with its history)."""

from __future__ import annotations

import os
import random
import signal

from tiny_models import make_tiny

from freetoken_agent import Engine, SamplingParams
from freetoken_agent.cli_reply import stream_reply


def test_ctrl_c_in_a_long_prefill_stops_after_the_running_chunk(tmp_path, rng_seed, capsys):
    rng = random.Random(rng_seed)
    make_tiny("qwen3_moe", tmp_path / "m", rng_seed)
    engine = Engine.load(tmp_path / "m", device="cpu", progress=False, max_batched_tokens=32,
                         kv_tokens=2048)  # fmt: skip
    prompt = [rng.randrange(3, 200) for _ in range(rng.randrange(320, 500))]  # 10+ chunks
    pressed_at = rng.randrange(1, 5)
    steps = []
    step = engine.step

    def counted():
        steps.append(len(steps))
        step()
        if len(steps) == pressed_at:  # as a terminal's Ctrl-C lands, mid-prefill
            os.kill(os.getpid(), signal.SIGINT)

    engine.step = counted
    text, stats = stream_reply(engine, prompt, SamplingParams(max_tokens=4, temperature=0.0))
    assert stats["finish"] == "interrupted" and stats["tokens"] == 0 and text == ""
    assert len(steps) == pressed_at  # no chunk after the one running
    assert not engine._requests  # the request was aborted and dropped
    engine.step = step
    again = engine.generate(
        [prompt[:40]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    )
    assert len(again[0].token_ids) == 3  # the engine goes on
    engine.close()
