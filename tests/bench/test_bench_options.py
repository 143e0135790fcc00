"""Every benchmark documents every option (`freetoken bench NAME --help`): issue 3 asks that
`freetoken bench --help` document every knob."""

import argparse
import importlib

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
        importlib.import_module(BENCHES[name]).main([])
    parser = parsed.value.parser
    assert parser.prog == f"freetoken bench {name}"
    undocumented = [a.option_strings or a.dest for a in parser._actions if not a.help]
    assert not undocumented, f"{name}: options without help: {undocumented}"
