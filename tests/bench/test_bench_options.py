"""Every benchmark documents every option (`freetoken bench NAME --help`): issue 3 asks that
`freetoken bench --help` document every knob."""

import argparse
import importlib
import random

import pytest

from freetoken_agent.bench.__main__ import BENCHES


class _Parsed(Exception):
    """Raised in place of parsing: the benchmark's parser, before it runs anything."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


@pytest.mark.parametrize("name", sorted(BENCHES))
def test_every_option_has_help(name, monkeypatch):
    def capture(self, args=None, namespace=None):
        raise _Parsed(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    with pytest.raises(_Parsed) as parsed:
        importlib.import_module(BENCHES[name].module).main([])
    parser = parsed.value.parser
    assert parser.prog == f"freetoken bench {name}"
    undocumented = [a.option_strings or a.dest for a in parser._actions if not a.help]
    assert not undocumented, f"{name}: options without help: {undocumented}"


def test_offload_refuses_a_context_the_kv_pool_cannot_hold(rng_seed, capsys):
    """`bench offload --context`: contexts whose sequences (and decoded tokens) overflow the
    engine's KV pool are refused before anything loads, naming the option."""
    from freetoken_agent.bench import offload

    rng = random.Random(rng_seed)
    batch = rng.choice([2, 4])
    context = offload.KV_TOKENS // batch + rng.randint(0, 1000)  # batch x context > the pool
    with pytest.raises(SystemExit) as exited:
        offload.main(["--context", str(context), "--batches", "1", str(batch)])
    assert exited.value.code == 2
    assert f"--context {context}" in capsys.readouterr().err


class _Loaded(Exception):
    """Raised in place of loading the benchmark's model: what it was asked to load."""


@pytest.mark.parametrize("layers", [12, 48, "other"])
def test_offload_defaults_the_peer_slices_budget_to_8_gib(layers, rng_seed, monkeypatch, capsys):
    """`--layers 12` is the issue's peer slice, measured under 8 GiB: at the 32 GB default
    every expert of its 12 layers fit (miss rate 0: no offload measured). Given budgets stand;
    a budget not above 0 is refused."""
    from freetoken_agent.bench import offload

    rng = random.Random(rng_seed)
    layers = rng.choice([2, 6, 24]) if layers == "other" else layers

    def loading(n_layers, budget_gb, chunk, lend_workspace=True):
        raise _Loaded(n_layers, budget_gb)

    monkeypatch.setattr(offload, "hbm_copy_bandwidth", lambda dev: 1.0)
    monkeypatch.setattr(offload, "host_read_bandwidth", lambda: 1.0)
    monkeypatch.setattr(offload, "offload_engine", loading)
    with pytest.raises(_Loaded) as loaded:
        offload.main(["--layers", str(layers)])
    budget = 8 * 2**30 / 1e9 if layers == 12 else 32.0
    assert loaded.value.args == (layers, budget)
    given = round(rng.uniform(1, 64), 2)
    with pytest.raises(_Loaded) as loaded:
        offload.main(["--layers", str(layers), "--budget-gb", str(given)])
    assert loaded.value.args == (layers, given)
    with pytest.raises(SystemExit) as exited:
        offload.main(["--budget-gb", rng.choice(["0", "-4", "nan", "inf"])])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "--budget-gb must be a finite number > 0" in err


def test_offload_refuses_a_copy_grid_outside_its_range(rng_seed, capsys):
    """`bench offload --copy-programs`: no grid below one program or past the most an engine
    takes, refused before anything loads."""
    from freetoken_agent.bench import offload

    bad = random.Random(rng_seed).choice([0, -8, offload.COPY_PROGRAMS_MAX + 1])
    with pytest.raises(SystemExit) as exited:
        offload.main(["--copy-programs", str(bad)])
    assert exited.value.code == 2
    assert (
        f"--copy-programs takes 1 to {offload.COPY_PROGRAMS_MAX}, got {bad}"
        in capsys.readouterr().err
    )


def test_offload_refuses_fewer_than_one_prefill_run(rng_seed, capsys):
    """`bench offload --prefill-repeats`: a row needs a run; 0 or fewer is refused before
    anything loads (it failed after the whole decode section with an IndexError)."""
    from freetoken_agent.bench import offload

    bad = random.Random(rng_seed).randint(-5, 0)
    with pytest.raises(SystemExit) as exited:
        offload.main(["--prefill-repeats", str(bad)])
    assert exited.value.code == 2
    assert f"--prefill-repeats must be >= 1, got {bad}" in capsys.readouterr().err


def test_split_cuts_refuses_a_cut_outside_the_expert(rng_seed, capsys):
    """`bench split-cuts --cuts`: a column past the expert's width is refused before anything
    loads, naming the option."""
    from freetoken_agent.bench import split_cuts

    width = split_cuts.offload.QWEN3_30B_A3B["moe_intermediate_size"]
    bad = random.Random(rng_seed).choice([width, width + 64, -16])
    with pytest.raises(SystemExit) as exited:
        split_cuts.main(["--cuts", "0", str(bad)])
    assert exited.value.code == 2
    assert f"--cuts [{bad}]" in capsys.readouterr().err
