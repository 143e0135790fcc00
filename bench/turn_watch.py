"""Evidence from a turn that runs long, before the device command's time limit kills it.

A benchmark turn on the device that never ends leaves nothing behind but the rows printed before
it (it happened: an elastic turn after the other program's take ran for minutes). `TurnWatch`
prints a heartbeat line every `every_s` while a turn runs (engine steps so far, the request's
progress and admissions, the split, free device memory and what torch's allocator holds), so a
crawl, a livelock (progress resetting) and a stall (no steps) look different in the log; and
after `stall_s` it dumps every thread's Python stack (faulthandler, repeated), which shows where
the host waits. Run the stage with CUDA_LAUNCH_BLOCKING=1 to make that the kernel at fault.
"""

from __future__ import annotations

import faulthandler
import sys
import time
from typing import TextIO

import torch

from freetoken_agent.engine.engine import Engine


def _fd_stream(stream: TextIO) -> TextIO:
    """`stream` if it has a file descriptor, else the process's stderr (a test captures
    sys.stderr into a buffer without one)."""
    try:
        stream.fileno()
        return stream
    except (OSError, AttributeError, ValueError):
        return sys.__stderr__


class TurnWatch:
    def __init__(
        self, engine: Engine, every_s: float = 10.0, stall_s: float = 120.0, out: TextIO = None
    ) -> None:
        self.engine, self.every_s, self.stall_s = engine, every_s, stall_s
        self.out = out or sys.stderr
        self._t0 = self._last = 0.0
        self._turn, self._rid = 0, None

    def start(self, turn: int, rid: int) -> None:
        self._turn, self._rid = turn, rid
        self._t0 = self._last = time.perf_counter()
        if self.stall_s > 0:  # faulthandler writes to a file descriptor, not a Python stream
            faulthandler.dump_traceback_later(self.stall_s, repeat=True, file=_fd_stream(self.out))

    def beat(self) -> None:
        """Before each step: a line when `every_s` passed since the last one."""
        now = time.perf_counter()
        if now - self._last < self.every_s:
            return
        self._last = now
        print(self.line(now - self._t0), file=self.out, flush=True)

    def line(self, elapsed: float) -> str:
        engine, mem = self.engine, self.engine.memory
        req = engine._requests.get(self._rid)
        parts = [f"watch turn {self._turn} {elapsed:.0f}s"]
        if req is not None:
            parts.append(
                f"computed {req.num_computed}/{req.n_tokens} out {len(req.output_ids)} "
                f"{req.status.name.lower()} admissions {req.admissions}"
            )
        if mem is not None:
            parts.append(
                f"step {mem.steps} budget {mem.budget / 1e9:.2f}GB "
                f"pages {engine.kv.allocator.n_pages} slots {mem.cache.n_slots} "
                f"map_failures {mem.map_failures}"
            )
        if torch.cuda.is_available():
            free, _ = torch.cuda.mem_get_info()
            parts.append(
                f"free {free / 1e9:.2f}GB torch_reserved {torch.cuda.memory_reserved() / 1e9:.2f}GB"
            )
        return "  ".join(parts)

    def stop(self) -> None:
        if self.stall_s > 0:
            faulthandler.cancel_dump_traceback_later()
