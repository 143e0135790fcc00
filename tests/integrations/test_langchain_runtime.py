"""Engines ChatFreeToken loads by path live for the process, once per settings; one that was
closed is loaded again, not handed out to refuse every request."""

from __future__ import annotations

import random

import pytest

from freetoken_agent import SamplingParams
from freetoken_agent.demo_model import ensure_demo_model
from freetoken_agent.integrations.langchain_runtime import load_service


@pytest.mark.parametrize("closing", ["service", "engine"])
def test_a_closed_engine_is_loaded_again(tmp_path, rng_seed, closing):
    rng = random.Random(rng_seed)
    path = str(ensure_demo_model(tmp_path))
    options = {"kv_tokens": 1024 + 64 * rng.randrange(8), "max_model_len": 512}
    first = load_service(path, "cpu", "resident", None, options)
    assert load_service(path, "cpu", "resident", None, options) is first  # once per settings
    first.close() if closing == "service" else first.engine.close()
    again = load_service(path, "cpu", "resident", None, options)
    assert again is not first and not again.closed and first.closed
    prompt = [rng.randrange(3, 900) for _ in range(8)]
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    events = list(again.stream(prompt, sp))
    assert [e.finish_reason for e in events] == [None] * 3 + ["length"]
    again.close()
