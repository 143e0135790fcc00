"""`freetoken bench` on a machine without CUDA: every benchmark's `--help` states its options'
defaults, the benchmarks the list marks as needing CUDA are refused in one line before their
modules (and triton) load, and the others are not refused."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import random
import re
import sys

import pytest
import torch

from freetoken_agent.bench.__main__ import BENCHES, main


def _module(name: str) -> str:
    return BENCHES[name].module


def _listing() -> dict[str, str]:
    """Each benchmark's entry in `freetoken bench --help`, its lines joined."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["--help"]) == 0
    entries: dict[str, str] = {}
    name = None
    for line in out.getvalue().splitlines():
        starts = re.match(r"    (\S+)\s+(.*)", line)
        if starts and starts.group(1) in BENCHES:
            name = starts.group(1)
            entries[name] = starts.group(2)
        elif name and line.startswith(" " * 20):
            entries[name] += " " + line.strip()
        else:
            name = None
    assert set(entries) == set(BENCHES), "every benchmark has its line in `bench --help`"
    return entries


LISTING = _listing()
# The list's mark of a benchmark that needs CUDA: "(CUDA)", "(CUDA; ...)" or "(needs CUDA)".
NEEDS_CUDA = sorted(n for n, text in LISTING.items() if re.search(r"\((needs )?CUDA[);]", text))


def _exit_code(argv: list[str]) -> int | str | None:
    try:
        return main(argv)
    except SystemExit as exited:
        return exited.code


class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def _parser(name: str, monkeypatch) -> argparse.ArgumentParser:
    """The benchmark's parser, caught where it would parse (nothing runs)."""

    def capture(self, args=None, namespace=None):
        raise _Parsed(self)

    with monkeypatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_args", capture)
        with pytest.raises(_Parsed) as parsed:
            importlib.import_module(_module(name)).main([])
    return parsed.value.parser


def _entries(text: str) -> dict[str, str]:
    """Each option's entry in a parser's help, by its first option string, whitespace joined."""
    entries: dict[str, str] = {}
    for block in re.split(r"\n(?=  -|\S)", text):
        if block.startswith("  -"):
            entries[block.split()[0].rstrip(",")] = " ".join(block.split())
    return entries


def _shown(default) -> str:
    """A default as typed on the command line: a list's values space-separated."""
    if isinstance(default, (list, tuple)):
        return " ".join(map(str, default)) if default else "none"
    return str(default)


@pytest.mark.parametrize("name", sorted(BENCHES))
def test_help_states_every_default(name, monkeypatch, capsys):
    """`freetoken bench NAME --help` works without CUDA and states each option's default once
    (the dispatcher's list promises "their defaults"); None and False need no mention."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _exit_code([name, "--help"]) == 0
    text = capsys.readouterr().out
    parser = _parser(name, monkeypatch)
    if parser.epilog:  # (offload's epilog lists the environment's defaults, not the options')
        text = text[: text.index(parser.epilog.splitlines()[0])]
    entries = _entries(text[text.index("options:") :])
    missing, doubled = [], []
    for action in parser._actions:
        default = action.default
        if not action.option_strings or default in (None, argparse.SUPPRESS) or default is False:
            continue
        entry = entries[action.option_strings[0]]
        if f"default: {_shown(default)})" not in entry:
            missing.append(f"{action.option_strings[0]} ({default!r}): {entry}")
        if entry.count("default:") + entry.count("(default ") > 1:
            doubled.append(entry)
    assert not missing, f"{name}: defaults not stated:\n" + "\n".join(missing)
    assert not doubled, f"{name}: defaults stated twice:\n" + "\n".join(doubled)


@pytest.mark.parametrize("name", NEEDS_CUDA)
def test_a_cuda_benchmark_is_refused_without_cuda(name, rng_seed, monkeypatch, capsys):
    """Without CUDA a benchmark the list marks "(CUDA)" exits 2 with one line on stderr that
    names it (and its CPU mode where it has one), before its module, and triton, load."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delitem(sys.modules, _module(name), raising=False)
    rng = random.Random(rng_seed)
    extra = rng.choice([[], ["--seed", str(rng.randrange(1 << 16))], ["--out", "/nonexistent"]])
    assert _exit_code([name, *extra]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert f"bench {name} " in lines[0] and "CUDA" in lines[0], lines[0]
    if "--cpu-smoke" in LISTING[name]:
        assert "--cpu-smoke" in lines[0], lines[0]
    assert _module(name) not in sys.modules, "refused before its module loads"


def test_help_without_triton_says_so_in_one_line(monkeypatch, capsys):
    """A CPU-only machine may lack triton (the CPU build of torch does not ship it): a kernel
    benchmark's `--help`, whose module imports it, says what is missing, not a traceback."""
    for loaded in [m for m in sys.modules if m.split(".")[0] == "triton"] + ["triton"]:
        monkeypatch.setitem(sys.modules, loaded, None)  # (as if not installed)
    monkeypatch.delitem(sys.modules, _module("kv-layout"), raising=False)
    assert _exit_code(["kv-layout", "--help"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "bench kv-layout needs triton" in err, err


def test_refused_are_exactly_the_benchmarks_the_list_marks(rng_seed, monkeypatch, capsys):
    """The refusal and the list's "(CUDA)" marks agree: a benchmark that runs on the CPU, or a
    CUDA one in its CPU mode, reaches its own main with its arguments untouched."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rng = random.Random(rng_seed)
    reached: dict[str, list[str]] = {}

    def stub(name: str, code: int):
        def run(argv: list[str]) -> int:
            reached[name] = argv
            return code

        return run

    refused, cpu_modes = set(), 0
    for name in sorted(BENCHES):
        code = rng.randrange(3, 100)  # what the stub returns, passed through unchanged
        monkeypatch.setattr(importlib.import_module(_module(name)), "main", stub(name, code))
        argv = ["--seed", str(rng.randrange(1 << 16))]
        got = _exit_code([name, *argv])
        if name in reached:
            assert reached.pop(name) == argv and got == code, name
        else:
            assert got == 2, name
            refused.add(name)
        if name in NEEDS_CUDA and "--cpu-smoke" in LISTING[name]:
            argv = ["--seed", str(rng.randrange(1 << 16))]
            argv.insert(rng.choice([0, 2]), "--cpu-smoke")
            assert _exit_code([name, *argv]) == code and reached.pop(name) == argv, name
            cpu_modes += 1
    capsys.readouterr()
    assert refused == set(NEEDS_CUDA)
    assert cpu_modes >= 2  # agent and elastic


def test_profile_offload_threads_says_what_the_code_does(monkeypatch):
    """`--threads` left out runs cpu_kernel.default_threads(): FREETOKEN_CPU_THREADS, else
    team_size() (the physical cores, less one without SMT), not all the physical cores."""
    parser = _parser("profile-offload", monkeypatch)
    text = " ".join(parser.format_help().split())
    entry = _entries(parser.format_help())["--threads"]
    assert "all physical cores" not in text
    assert "FREETOKEN_CPU_THREADS" in entry and "less one" in entry and "SMT" in entry, entry


def test_a_default_longer_than_a_line_is_not_broken(rng_seed):
    """A default path under a long folder (a CI clone's) was wrapped inside the word, so the
    help no longer held it."""
    import argparse
    import random

    from freetoken_agent.help_format import DefaultsHelpFormatter

    rng = random.Random(rng_seed)
    path = "/tmp/" + "".join(rng.choices("abcdefgh", k=rng.randint(90, 140))) + "/out.json"
    parser = argparse.ArgumentParser(formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--out", default=path, help="where the JSON goes")
    assert path in " ".join(parser.format_help().split())
