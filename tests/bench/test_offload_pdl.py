"""bench offload's --pdl and --l2: each measurement runs under its FREETOKEN_PDL value and
l2_prefetch setting, with the decode graphs captured again under them (a graph keeps the
launches it was captured with); and its --hold-share rows, one adaptive row per share."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from freetoken_agent.bench import offload, offload_decode
from freetoken_agent.bench.kernel_variants import kernel_variant, measured_variants
from freetoken_agent.kernels import pdl_switch
from freetoken_agent.kernels.triton import pdl


class _Engine:
    def __init__(self, graphs):
        self.runner = SimpleNamespace(graphs=graphs)
        model = SimpleNamespace(modules=lambda: [], parameters=lambda: iter([torch.zeros(1)]))
        self.loaded = SimpleNamespace(
            model=model, bank=SimpleNamespace(l2="unset"), device=torch.device("cpu")
        )
        self.captured: list[tuple[int, object]] = []  # (PDL flags, the bank's prefetcher)

    def capture_graphs(self):
        self.captured.append((pdl.requested(), self.loaded.bank.l2))


def test_each_variant_captures_under_itself_and_measures_under_itself(monkeypatch, rng_seed):
    monkeypatch.delenv("FREETOKEN_PDL", raising=False)
    rng = random.Random(rng_seed)
    cases = [(w, rng.choice([None, False, True]))
             for w in rng.sample(["on", "exit", "light", "prefetch", "off"], 3)]  # fmt: skip
    engine = _Engine(graphs=object())
    for word, l2 in cases:
        with kernel_variant(engine, word, l2):
            assert pdl.requested() == pdl.flags(word)  # the measurement's eager launches
        assert pdl.requested() == pdl.flags(pdl_switch.DEFAULT)  # the environment's: unset
    for (word, l2), (flags, prefetcher) in zip(cases, engine.captured, strict=True):
        assert flags == pdl.flags(word)
        if l2 is not None:  # set before the capture: on gives a prefetcher, off none
            assert (prefetcher is not None and prefetcher != "unset") == l2
    monkeypatch.setenv("FREETOKEN_PDL", "exit")
    with kernel_variant(engine, None, True):  # l2 alone: PDL as the environment says
        assert pdl.requested() == pdl.WAIT
    assert len(engine.captured) == len(cases) + 1
    with kernel_variant(engine, None, None):  # neither: as loaded, no capture
        pass
    assert len(engine.captured) == len(cases) + 1
    uncaptured = _Engine(graphs=None)  # an eager engine: nothing to capture
    with kernel_variant(uncaptured, cases[0][0], None):
        assert pdl.requested() == pdl.flags(cases[0][0])
    assert uncaptured.captured == []


def test_rows_are_named_by_what_varies(rng_seed):
    rng = random.Random(rng_seed)
    policies = rng.sample(["adaptive", "transfer", "gpu-fill"], rng.randint(1, 3))
    assert measured_variants(policies, None, None) == [(p, p, None, None) for p in policies]
    rows = measured_variants(policies, ["off", "light"], ["off", "on"])
    assert len(rows) == 4 * len(policies) and len({name for name, *_ in rows}) == len(rows)
    for name, policy, word, l2 in rows:
        assert name == f"{policy}@{word}" + ("+l2" if l2 else "")
    # one value given: applied, and the row keeps the policy's name
    assert measured_variants(policies, ["prefetch"], ["on"]) == [
        (p, p, "prefetch", True) for p in policies
    ]


def test_held_shares_make_one_adaptive_row_each(rng_seed):
    rng = random.Random(rng_seed)
    policies = rng.sample(["adaptive", "transfer", "gpu-fill"], 3)
    variants = measured_variants(policies, None, None)
    assert offload_decode.held_shares(variants, None) == [(*v, None) for v in variants]
    shares = sorted(rng.sample([0.3, 0.45, 0.6, 0.75, 0.9], rng.randint(1, 4)))
    rows = offload_decode.held_shares(variants, shares)
    assert len(rows) == len(policies) - 1 + len(shares)
    held = [(name, x) for name, policy, _, _, x in rows if policy == "adaptive"]
    assert held == [(f"adaptive~{x:g}", x) for x in shares]
    assert all(x is None for _, policy, _, _, x in rows if policy != "adaptive")


def test_hold_share_needs_the_shared_path_and_fractions(capsys):
    for argv, why in (
        (["--hold-share", "0.5"], "give --adaptive-path shared"),
        (["--adaptive-path", "shared", "--hold-share", "1.5"], "fractions in"),
    ):
        with pytest.raises(SystemExit):
            offload.main(argv)
        assert why in capsys.readouterr().err
