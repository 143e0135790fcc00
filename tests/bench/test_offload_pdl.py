"""bench offload's --pdl: each measurement runs under its FREETOKEN_PDL value, with the decode
graphs captured again under it (a graph keeps the launches it was captured with)."""

from __future__ import annotations

import random
from types import SimpleNamespace

from freetoken_agent.bench.offload import pdl_variant
from freetoken_agent.kernels.triton import pdl


class _Engine:
    def __init__(self, graphs):
        self.runner = SimpleNamespace(graphs=graphs)
        self.captured: list[int] = []  # the PDL flags each capture ran under

    def capture_graphs(self):
        self.captured.append(pdl.requested())


def test_each_word_captures_under_itself_and_measures_under_itself(monkeypatch, rng_seed):
    monkeypatch.delenv("FREETOKEN_PDL", raising=False)
    words = random.Random(rng_seed).sample(["on", "exit", "light", "prefetch", "off"], 3)
    engine = _Engine(graphs=object())
    for word in words:
        with pdl_variant(engine, word):
            assert pdl.requested() == pdl.flags(word)  # the measurement's eager launches
        assert pdl.requested() == 0  # back to the environment's
    assert engine.captured == [pdl.flags(w) for w in words]
    with pdl_variant(engine, None):  # no --pdl: the environment's value, no capture
        assert pdl.requested() == 0
    assert len(engine.captured) == len(words)
    uncaptured = _Engine(graphs=None)  # eager engine: nothing to capture
    with pdl_variant(uncaptured, words[0]):
        assert pdl.requested() == pdl.flags(words[0])
    assert uncaptured.captured == []
