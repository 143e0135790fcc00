"""A device shared with another program, simulated: the elastic benchmark's --cpu-smoke and tests.

On the CPU there is no driver to ask and no second process: the device is `total` bytes, the
engine holds `engine_used()` of them (its MemoryManager's fixed + mapped bytes, or a fixed
split's whole budget) and the other program holds `others` (ballast + taken). Free memory is
what is left; the engine follows it through `free_memory`, as on CUDA it follows
`torch.cuda.mem_get_info`.

The other program has the same commands as bench/vram_hog.py's `VramHog`, in steps instead of
seconds: `take_async` sets a target and `take_step` (called by the benchmark between engine
steps and polls, where on CUDA the real program runs in parallel) grabs whatever is free, up to
the target; after `timeout_steps` steps without reaching it the take ends incomplete, as the
real one ends after its timeout. The reply comes through `wait_reply`.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class SimulatedDevice:
    def __init__(self, total: int, engine_used: Callable[[], int]) -> None:
        self.total, self.engine_used = total, engine_used
        self.ballast_bytes = 0
        self.taken = 0  # what the current (or last) take holds
        self._target = self._asked = 0
        self._steps = self._timeout_steps = 0
        self._start = 0.0
        self._pending = False
        self._reply: dict | None = None

    @property
    def others(self) -> int:
        return self.ballast_bytes + self.taken

    def free_memory(self) -> tuple[int, int]:
        """(free, total) bytes, as the driver would say."""
        return max(0, self.total - self.others - self.engine_used()), self.total

    def ballast(self, leave: int) -> dict:
        self.ballast_bytes += max(0, self.free_memory()[0] - leave)
        return {"ballast": self.ballast_bytes, "free": self.free_memory()[0]}

    def take_async(self, nbytes: int, timeout_steps: int) -> None:
        """Start taking `nbytes` more; the first step runs at once."""
        self._target = self.taken + nbytes
        self._asked, self._steps, self._timeout_steps = nbytes, 0, timeout_steps
        self._start, self._pending, self._reply = time.perf_counter(), True, None
        self.take_step()

    def take_step(self) -> None:
        """One retry of the running take: grab what is free, up to the target."""
        if not self._pending:
            return
        self._steps += 1
        self.taken += min(self.free_memory()[0], self._target - self.taken)
        if self.taken >= self._target or self._steps >= self._timeout_steps:
            self._pending = False
            got = self._asked - (self._target - self.taken)
            self._reply = {
                "got": got,
                "steps": self._steps,
                "seconds": time.perf_counter() - self._start,  # wall time of the CPU run
                "complete": self.taken >= self._target,
                "free": self.free_memory()[0],
            }

    def wait_reply(self, timeout: float | None = None) -> dict | None:
        """One more step of a running take; its reply once it ended (then None again)."""
        self.take_step()
        reply, self._reply = self._reply, None
        return reply

    def release(self) -> dict:
        released, self.taken, self._pending = self.taken, 0, False
        return {"released": released, "free": self.free_memory()[0]}

    def close(self) -> None:
        self.ballast_bytes = self.taken = 0
        self._pending = False
