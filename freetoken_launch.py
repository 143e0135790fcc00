"""The `freetoken` command's entry point, outside the package.

Importing `freetoken_agent` loads torch (seconds on a laptop), and the command's own handler of
Ctrl-C (`freetoken_agent.cli.main`) exists only once that import is done: a Ctrl-C while the
command started printed the import's traceback. Here the import itself is guarded, and such a
Ctrl-C ends the command as one during it does: an empty line on stderr, exit status 130.
"""

from __future__ import annotations

import signal
import sys


def main() -> int:
    try:
        from freetoken_agent.cli import main as cli_main
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        return 128 + signal.SIGINT
    return cli_main()


if __name__ == "__main__":
    raise SystemExit(main())
