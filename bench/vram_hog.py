"""Another program that takes device memory: the elastic benchmark's pressure, for real.

    python -m freetoken_agent.bench.vram_hog [--device 0] [--simulate-bytes N]

A separate process (its own CUDA context, its own allocator), so what it gets is what the
driver gives it: an engine in the benchmark's process can only make room by returning memory
to the driver. Driven by JSON lines on stdin, one JSON line answered on stdout per command:

    {"cmd": "ballast", "leave": BYTES}   take memory until the device has at most BYTES free
                                         -> {"ballast": held, "free": ...}
    {"cmd": "take", "bytes": N, "timeout_s": T}
                                         take N bytes in PIECE pieces; a piece the device
                                         refuses is retried every RETRY_S until N are held or
                                         T seconds passed (as a program whose allocator retries)
                                         -> {"got": ..., "seconds": ..., "complete": ..., "free"}
    {"cmd": "release"}                   free what `take` got (the ballast stays)
                                         -> {"released": ..., "free": ...}
    {"cmd": "quit"}                      -> {"quit": true}, then exit

First line, before any command: {"ready": true, "free": ..., "total": ..., "pid": ...}. A command
that fails answers {"error": "..."} and the program goes on. `Hog` is the logic over any
allocator: the CUDA one, or with --simulate-bytes a device of N bytes that are only counted
(`CountedMemory`: the protocol without a GPU, for tests). `VramHog` is the benchmark's client.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable

PIECE = 256 << 20  # bytes per allocation: a program's buffers, not one giant block
GRAIN = 2 << 20  # the CUDA allocator rounds large blocks to 2 MiB: finer leaves are noise
RETRY_S = 0.02  # between tries of a refused piece


class Hog:
    """What the other program holds. `allocate(n)` returns an object holding n bytes (freed
    when dropped) or raises MemoryError; `free_memory()` -> (free, total) bytes of the device."""

    def __init__(
        self,
        allocate: Callable[[int], object],
        free_memory: Callable[[], tuple[int, int]],
        empty_cache: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._allocate, self.free_memory, self._empty_cache = allocate, free_memory, empty_cache
        self._clock, self._sleep = clock, sleep
        self.ballast_pieces: list[tuple[object, int]] = []
        self.taken: list[tuple[object, int]] = []

    @property
    def ballast_bytes(self) -> int:
        return sum(n for _, n in self.ballast_pieces)

    @property
    def taken_bytes(self) -> int:
        return sum(n for _, n in self.taken)

    def free(self) -> int:
        return self.free_memory()[0]

    def ballast(self, leave: int) -> dict:
        """Allocate until at most `leave` bytes (+ one GRAIN) are free; stops early when the
        device refuses a piece or an allocation does not lower free memory (nothing to take)."""
        free = self.free()
        while (n := min(PIECE, (free - leave) // GRAIN * GRAIN)) > 0:
            try:
                self.ballast_pieces.append((self._allocate(n), n))
            except MemoryError:
                break
            before, free = free, self.free()
            if free >= before:
                break
        return {"ballast": self.ballast_bytes, "free": self.free()}

    def take(self, nbytes: int, timeout_s: float) -> dict:
        """`nbytes` more in PIECE pieces, each refused one retried until `timeout_s` passed."""
        start = self._clock()
        got = 0
        while got < nbytes:
            n = min(PIECE, nbytes - got)
            try:
                self.taken.append((self._allocate(n), n))
                got += n
                continue
            except MemoryError:
                pass
            if self._clock() - start >= timeout_s:
                break
            self._sleep(RETRY_S)
        seconds = self._clock() - start
        return {"got": got, "seconds": seconds, "complete": got >= nbytes, "free": self.free()}

    def release(self) -> dict:
        released = self.taken_bytes
        self.taken.clear()
        self._empty_cache()
        return {"released": released, "free": self.free()}

    def handle(self, msg: dict) -> dict:
        cmd = msg.get("cmd")
        if cmd == "ballast":
            return self.ballast(int(msg["leave"]))
        if cmd == "take":
            return self.take(int(msg["bytes"]), float(msg["timeout_s"]))
        if cmd == "release":
            return self.release()
        if cmd == "quit":
            return {"quit": True}
        return {"error": f"unknown command {cmd!r}"}


def serve(hog: Hog, lines: Iterable[str], write: Callable[[dict], None]) -> None:
    """Answer each command line until "quit" or the end of input."""
    for line in lines:
        if not line.strip():
            continue
        try:
            reply = hog.handle(json.loads(line))
        except Exception as e:  # noqa: BLE001 - a bad command is answered, the program goes on
            reply = {"error": f"{type(e).__name__}: {e}"}
        write(reply)
        if reply.get("quit"):
            return


class _Counted:
    """Stands for an allocation: its bytes count as used while it lives."""

    def __init__(self, memory: CountedMemory, n: int) -> None:
        self.memory, self.n = memory, n

    def __del__(self) -> None:
        self.memory.used -= self.n


class CountedMemory:
    """A device of `total` bytes whose allocations are counted, not made."""

    def __init__(self, total: int) -> None:
        self.total, self.used = total, 0

    def allocate(self, n: int) -> object:
        if self.used + n > self.total:
            raise MemoryError(f"{n} bytes asked, {self.total - self.used} free")
        self.used += n
        return _Counted(self, n)

    def free_memory(self) -> tuple[int, int]:
        return self.total - self.used, self.total


def cuda_hog(device: int) -> Hog:
    import torch

    dev = torch.device("cuda", device)
    torch.cuda.set_device(dev)
    torch.ones(1, device=dev)  # the CUDA context exists before the first command measures
    torch.cuda.empty_cache()

    def allocate(n: int) -> object:
        try:
            return torch.empty(n, dtype=torch.uint8, device=dev)
        except torch.OutOfMemoryError as e:
            raise MemoryError(str(e).splitlines()[0]) from e

    return Hog(allocate, lambda: torch.cuda.mem_get_info(dev), torch.cuda.empty_cache)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m freetoken_agent.bench.vram_hog")
    parser.add_argument("--device", type=int, default=0, help="CUDA device index")
    text = "no GPU: a device of this many bytes, counted (tests the protocol)"
    parser.add_argument("--simulate-bytes", type=int, default=None, help=text)
    args = parser.parse_args(argv)
    if args.simulate_bytes is None:
        hog = cuda_hog(args.device)
    else:
        mem = CountedMemory(args.simulate_bytes)
        hog = Hog(mem.allocate, mem.free_memory)
    free, total = hog.free_memory()

    def write(reply: dict) -> None:
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()

    write({"ready": True, "free": free, "total": total, "pid": os.getpid()})
    serve(hog, sys.stdin, write)
    return 0


class VramHog:
    """The benchmark's handle on the other program: a subprocess running `main`."""

    def __init__(
        self, device: int = 0, python: str = sys.executable, simulate_bytes: int | None = None
    ) -> None:
        self.device, self.python, self.simulate_bytes = device, python, simulate_bytes
        self.proc: subprocess.Popen | None = None
        self._replies: queue.Queue[dict | None] = queue.Queue()
        self.ready: dict | None = None

    def start(self, timeout_s: float = 120.0) -> dict:
        cmd = [self.python, "-m", "freetoken_agent.bench.vram_hog", "--device", str(self.device)]
        if self.simulate_bytes is not None:
            cmd += ["--simulate-bytes", str(self.simulate_bytes)]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )
        threading.Thread(target=self._read, daemon=True).start()
        self.ready = self._expect("ready", timeout_s)
        return self.ready

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                self._replies.put(json.loads(line))
            except ValueError:  # not a reply (a library printing): shown, not parsed
                if line.strip():
                    sys.stderr.write(f"vram hog: {line}")
        self._replies.put(None)  # end of output: the process is gone

    def _send(self, msg: dict) -> None:
        assert self.proc is not None and self.proc.stdin is not None, "start() first"
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()

    def wait_reply(self, timeout: float | None) -> dict | None:
        """The next reply, or None if none came within `timeout` seconds."""
        try:
            reply = self._replies.get(timeout=timeout)
        except queue.Empty:
            return None
        if reply is None:
            self._replies.put(None)  # stays ended for later calls
            rc = self.proc.poll() if self.proc else None
            raise RuntimeError(f"the vram hog exited (rc {rc})")
        return reply

    def _expect(self, key: str, timeout_s: float) -> dict:
        reply = self.wait_reply(timeout_s)
        if reply is None:
            raise TimeoutError(f"the vram hog did not answer within {timeout_s} s")
        if key not in reply:
            raise RuntimeError(f"the vram hog answered {reply} (expected {key!r})")
        return reply

    def ballast(self, leave: int, timeout_s: float = 120.0) -> dict:
        self._send({"cmd": "ballast", "leave": int(leave)})
        return self._expect("ballast", timeout_s)

    def take_async(self, nbytes: int, timeout_s: float) -> None:
        """Start a take; its reply comes through `wait_reply`."""
        self._send({"cmd": "take", "bytes": int(nbytes), "timeout_s": float(timeout_s)})

    def release(self, timeout_s: float = 60.0) -> dict:
        self._send({"cmd": "release"})
        return self._expect("released", timeout_s)

    def free_memory(self) -> tuple[int, int]:
        """(free, total) bytes of the device, as every process sees it (simulated: unknown
        here, the counted device lives in the other process)."""
        if self.simulate_bytes is not None:
            raise RuntimeError("a simulated hog's memory is counted in its own process")
        import torch

        return torch.cuda.mem_get_info(self.device)

    def close(self, timeout_s: float = 30.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                self._send({"cmd": "quit"})
                self.proc.wait(timeout_s)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.proc = None


if __name__ == "__main__":
    raise SystemExit(main())
