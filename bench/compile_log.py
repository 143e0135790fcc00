"""Which Triton kernels compile while a benchmark measures, and for how long.

A compile inside a timed turn costs seconds (ptxas and LLVM run on the host): the elastic
benchmark's TTFT outliers were such compiles, found by profiling one turn at a time. `CompileLog`
hooks Triton's JIT (knobs.runtime.jit_cache_hook before a new variant is built, and
jit_post_compile_hook after) and records every variant built from then on: the kernel, the
specialisation of its arguments (Triton's cache key: dtypes, which integers were specialised
as 1 or as divisible by 16, which pointers as 16-byte aligned, the constexprs) and the seconds
it took. `take()` hands over what was
recorded since the last call, so a benchmark can attach each turn's compiles to its row.

Without Triton (a CPU machine) or without those hooks (an older Triton), nothing is recorded
and `available` says so.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

KEY_CHARS = 1500  # of a printed line: a kernel of ~40 arguments spells its key in ~1,000


class CompileLog:
    def __init__(self, out: TextIO | None = None) -> None:
        self.out = out
        self._records: list[dict] = []
        self._started: dict[str, float] = {}
        self._knobs = None
        self.available = False
        try:
            import triton
        except ImportError:
            return
        runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
        if not all(hasattr(runtime, h) for h in ("jit_cache_hook", "jit_post_compile_hook")):
            return
        self._knobs = runtime
        self._previous = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
        runtime.jit_cache_hook = self._before
        runtime.jit_post_compile_hook = self._after
        self.available = True

    def _before(self, *, key, repr, fn, **_) -> bool:
        self._started[str(key)] = time.perf_counter()
        return False  # compile as usual

    def _after(self, *, key, repr, fn, **_) -> bool:
        start = self._started.pop(str(key), None)
        seconds = time.perf_counter() - start if start is not None else None
        # Triton's `repr` of a variant stops at the first argument (Triton 3.6), so the cache
        # key goes with it: it spells every argument's specialisation and the constexprs,
        # which tells two variants of one kernel apart (what changed between the calls).
        record = {
            "kernel": getattr(fn, "name", str(fn)),
            "variant": repr,
            "key": " ".join(str(key).split()),
            "seconds": seconds,
        }
        self._records.append(record)
        if self.out is not None:
            took = "-" if seconds is None else f"{seconds:.2f}s"
            line = f"compile {record['kernel']} {took} {record['key']}"
            print(line[:KEY_CHARS], file=self.out, flush=True)
        return False

    def take(self) -> list[dict]:
        """The variants built since the last call (oldest first)."""
        out, self._records = self._records, []
        return out

    def close(self) -> None:
        if self._knobs is not None:
            self._knobs.jit_cache_hook, self._knobs.jit_post_compile_hook = self._previous
            self._knobs = None


def stderr_log() -> CompileLog:
    return CompileLog(sys.stderr)
