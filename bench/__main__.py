"""`python -m freetoken_agent.bench NAME [options]` / `freetoken bench NAME [options]`.

    decode   all-resident decode and prefill beside the HBM limit (needs CUDA)
    offload  experts in host memory: decode per policy, streamed prefill (needs CUDA)

`freetoken bench NAME --help` lists that benchmark's options.
"""

from __future__ import annotations

import importlib
import sys

BENCHES = {
    "decode": "freetoken_agent.bench.decode_baseline",
    "offload": "freetoken_agent.bench.offload",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv or argv[0] not in BENCHES:
        print(__doc__.strip(), file=sys.stderr if argv else sys.stdout)
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\nunknown benchmark {argv[0]!r}; choose one of {', '.join(BENCHES)}")
            return 2
        return 0
    return importlib.import_module(BENCHES[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
