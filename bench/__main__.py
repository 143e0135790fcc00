"""`python -m freetoken_agent.bench` / `freetoken bench`: pick a benchmark by name."""

from __future__ import annotations

import argparse
import sys

BENCHES = {
    "decode": "freetoken_agent.bench.decode_baseline",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    parser = argparse.ArgumentParser(prog="freetoken bench")
    parser.add_argument("name", choices=sorted(BENCHES), help="which benchmark")
    args, rest = parser.parse_known_args(argv)
    import importlib

    return importlib.import_module(BENCHES[args.name]).main(rest)


if __name__ == "__main__":
    raise SystemExit(main())
