"""The other program beside an engine in bench/elastic.py, and the memory columns of a turn.

`Pressure` drives bench/vram_hog.py (a subprocess on its own CUDA context) or, on the CPU,
bench/simulated_device.py (the elastic engine then watches the simulated free memory): a
ballast after warm-up, a take before the pressure turn, polls of the idle engine until the take
answers, a release and polls until the elastic budget is back. What was asked, got and
released, and the budget around it, go to the engine's `pressure` record.
"""

from __future__ import annotations

import math
import time

import torch

from freetoken_agent.bench.simulated_device import SimulatedDevice
from freetoken_agent.bench.vram_hog import PIECE, VramHog
from freetoken_agent.engine.engine import Engine

POLL_S = 0.05  # the idle engine's polls while the other program takes or after it released
HOG_MARGIN_S = 30.0  # the other program answers a take at its timeout; later than this: stuck


class Pressure:
    """Another program beside one engine (module docstring): bench/vram_hog.py on CUDA,
    bench/simulated_device.py on the CPU (with the elastic engine watching its free memory).
    What it was asked, got and released, and the engine's budget around it, go to `record`."""

    def __init__(self, args, engine: Engine, record: dict) -> None:
        self.args, self.engine, self.record = args, engine, record
        self.active = False
        self.budget_before: int | None = None
        mem = engine.memory
        if args.cpu_smoke:
            reserve = args.smoke_reserve
            used = mem.used_bytes if mem is not None else lambda: args.budget
            self.other = SimulatedDevice(4 * args.budget, used)
            if mem is not None:
                mem.watch(self.other.free_memory, reserve=reserve, poll_s=0)
            self.tick = self.other.take_step
            self.timeout = math.ceil(args.pressure_timeout_s / POLL_S)  # steps: one per poll
            self.pause, self.slack = 0.0, 0
        else:
            reserve = engine.config.memory_reserve
            self.other = VramHog(torch.cuda.current_device())
            self.tick, self.timeout = None, args.pressure_timeout_s
            self.pause, self.slack = POLL_S, PIECE
        # The elastic arena maps what it uses: what it may still map up to its budget is its
        # own, so that stays free beside the reserve and the headroom.
        room = max(0, mem.user_budget - mem.held_bytes()) if mem is not None else 0
        leave = reserve + args.headroom + room
        record.update(reserve=reserve, headroom=args.headroom, leave=leave)
        try:
            if isinstance(self.other, VramHog):
                record["hog"] = self.other.start()
            record["ballast"] = self.other.ballast(leave)["ballast"]
        except BaseException:
            self.other.close()
            raise
        record["free_after_ballast"] = self.free()

    def free(self) -> int:
        return self.other.free_memory()[0]

    def _budget(self) -> int | None:
        return self.engine.memory.budget if self.engine.memory is not None else None

    def before_turn(self, turn: int) -> None:
        a = self.args
        try:
            if turn == a.pressure_turn:
                self.budget_before = self._budget()
                self.record.update(asked=a.pressure_bytes, budget_before=self.budget_before)
                self.active = True
                self.other.take_async(a.pressure_bytes, self.timeout)
            elif turn == a.pressure_turn + a.pressure_turns and self.active:
                self._release()
        except (RuntimeError, OSError) as e:  # the other program died: recorded, no crash
            self.record["error"] = f"{type(e).__name__}: {e}"

    def after_turn(self, turn: int) -> None:
        """After the pressure turn: poll the idle engine until the other program answers."""
        if turn != self.args.pressure_turn or not self.active:
            return
        polls = math.ceil((self.args.pressure_timeout_s + HOG_MARGIN_S) / POLL_S)
        reply = None
        try:
            for _ in range(polls):
                self.engine.poll_memory()
                if (reply := self.other.wait_reply(self.pause)) is not None:
                    break
        except (RuntimeError, OSError) as e:
            self.record["error"] = f"{type(e).__name__}: {e}"
        if reply is None:
            self.record.setdefault("error", f"no answer to the take within {polls} polls")
        else:
            self.record.update(reply)
        self.record["budget_under"] = self._budget()

    def _release(self) -> None:
        """The other program frees what it took; poll until the budget is back (elastic)."""
        self.active = False
        self.record["released"] = self.other.release()["released"]
        if self.budget_before is None:
            return
        t0 = time.perf_counter()
        target = self.budget_before - self.slack
        for _ in range(math.ceil(self.args.pressure_timeout_s / POLL_S)):
            if self.engine.poll_memory() >= target:
                break
            time.sleep(self.pause)
        budget = self._budget()
        self.record["recovery"] = {
            "seconds": time.perf_counter() - t0,
            "budget": budget,
            "back": budget >= target,
        }

    def close(self) -> None:
        self.other.close()


def memory_row(row: dict, engine: Engine, args, pressure: Pressure | None) -> None:
    """The turn's memory columns: slots, pages, budget, mapped and free bytes."""
    st = engine.stats()
    mem = engine.memory
    row["slots"] = st["experts"].get("slots")
    row["kv_pages"] = st["memory"]["kv_pages"]
    row["budget_gb"] = (mem.budget if mem else args.budget) / 1e9
    row["mapped_gb"] = mem.mapped_bytes / 1e9 if mem else None
    if pressure is not None:
        row["free_gb"] = pressure.free() / 1e9
    elif torch.cuda.is_available() and not args.cpu_smoke:
        row["free_gb"] = torch.cuda.mem_get_info()[0] / 1e9
    else:
        row["free_gb"] = None
    row["engine_errors"] = st["requests"]["errors"]
    if mem is not None:  # the trace so far: a cut run keeps it too
        row["step"] = mem.steps
        row["map_failures"] = mem.map_failures
