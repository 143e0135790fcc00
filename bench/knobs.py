"""Integer options with two defaults: the device run's and the `--cpu-smoke` run's.

A knob is (flag, device default, smoke default, help). `add_knobs` declares them with both
defaults in the help; `resolve_knobs` fills the ones left unset once `--cpu-smoke` is known.
"""

from __future__ import annotations

import argparse

Knob = tuple[str, int, int, str]


def add_knobs(parser: argparse.ArgumentParser, knobs: tuple[Knob, ...]) -> None:
    for flag, device, small, text in knobs:
        help_text = f"{text} (default {device}; with --cpu-smoke {small})"
        parser.add_argument(flag, type=int, default=None, help=help_text)


def resolve_knobs(args: argparse.Namespace, knobs: tuple[Knob, ...]) -> None:
    for flag, device, small, _ in knobs:
        name = flag[2:].replace("-", "_")
        if getattr(args, name) is None:
            setattr(args, name, small if args.cpu_smoke else device)
