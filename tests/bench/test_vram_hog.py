"""The other program of the elastic benchmark: bench/vram_hog.py's logic over a fake device (a
fake clock, memory another party frees at set times), its protocol through a real subprocess
on a counted device, and bench/simulated_device.py's step-wise take."""

from __future__ import annotations

import json
import random

import pytest

from freetoken_agent.bench.simulated_device import SimulatedDevice
from freetoken_agent.bench.vram_hog import GRAIN, PIECE, RETRY_S, Hog, VramHog, serve

GiB = 1 << 30


class FakeDevice:
    """`total` bytes; an allocation counts while its block lives; `frees[t] = n`: at time t
    another party (an engine yielding) gives n bytes back. Time moves only in `sleep`."""

    def __init__(self, total: int, engine: int = 0) -> None:
        self.total, self.used, self.engine = total, 0, engine
        self.now = 0.0
        self.frees: dict[float, int] = {}
        self.sleeps = 0
        self.pieces: list[int] = []
        self.emptied = 0

    def allocate(self, n: int) -> object:
        if n > self.free_memory()[0]:
            raise MemoryError(f"{n} bytes")
        self.used += n
        self.pieces.append(n)
        return Block(self, n)

    def free_memory(self) -> tuple[int, int]:
        return self.total - self.used - self.engine, self.total

    def sleep(self, dt: float) -> None:
        self.sleeps += 1
        self.now += dt
        for t in [t for t in self.frees if t <= self.now]:
            self.engine -= self.frees.pop(t)

    def hog(self) -> Hog:
        return Hog(self.allocate, self.free_memory, self._empty, lambda: self.now, self.sleep)

    def _empty(self) -> None:
        self.emptied += 1


class Block:
    def __init__(self, dev: FakeDevice, n: int) -> None:
        self.dev, self.n = dev, n

    def __del__(self) -> None:
        self.dev.used -= self.n


def _expected_got(free: int, asked: int) -> int:
    """Whole pieces, in order, while they fit (the last piece is the remainder)."""
    got = 0
    while got < asked and min(PIECE, asked - got) <= free - got:
        got += min(PIECE, asked - got)
    return got


def test_ballast_leaves_what_was_asked(rng_seed):
    rng = random.Random(rng_seed)
    dev = FakeDevice(rng.randrange(4 * GiB, 64 * GiB), engine=rng.randrange(GiB))
    leave = rng.randrange(dev.free_memory()[0] // 2)
    hog = dev.hog()  # what it holds lives as long as it does
    reply = hog.ballast(leave)
    free = dev.free_memory()[0]
    assert leave <= free < leave + GRAIN
    assert reply == {"ballast": dev.used, "free": free}
    assert max(dev.pieces) <= PIECE and all(p % GRAIN == 0 for p in dev.pieces)


def test_ballast_stops_when_nothing_more_can_be_taken(rng_seed):
    rng = random.Random(rng_seed)
    dev = FakeDevice(rng.randrange(4 * GiB, 16 * GiB))
    cap = rng.randrange(GiB, 2 * GiB)  # fragmentation: the device refuses beyond this
    allocate = dev.allocate

    def fragmented(n: int) -> object:
        if dev.used + n > cap:
            raise MemoryError(f"{n} bytes")
        return allocate(n)

    hog = Hog(fragmented, dev.free_memory)
    assert hog.ballast(0)["ballast"] == dev.used > cap - PIECE
    lying = FakeDevice(8 * GiB)  # free memory that never drops (nothing is really taken)
    hog = Hog(lying.allocate, lambda: (8 * GiB, 8 * GiB))
    assert hog.ballast(0)["ballast"] == PIECE  # one try, then it stops instead of looping


def test_take_gives_up_at_its_timeout_with_what_it_got(rng_seed):
    rng = random.Random(rng_seed)
    dev = FakeDevice(64 * GiB)
    hog = dev.hog()
    hog.ballast(rng.randrange(GiB, 4 * GiB))
    free = dev.free_memory()[0]
    asked = rng.randrange(free + 1, free + 8 * GiB)
    timeout = rng.uniform(0.5, 3.0)
    reply = hog.take(asked, timeout)
    assert reply["got"] == _expected_got(free, asked) < asked
    assert reply["complete"] is False
    assert timeout <= reply["seconds"] < timeout + RETRY_S + 1e-9  # retried every RETRY_S
    assert dev.sleeps == pytest.approx(timeout / RETRY_S, abs=1)
    assert reply["free"] == free - reply["got"] == dev.free_memory()[0]


def test_take_retries_until_the_other_party_gives_memory_back(rng_seed):
    rng = random.Random(rng_seed)
    dev = FakeDevice(80 * GiB, engine=40 * GiB)
    hog = dev.hog()
    hog.ballast(rng.randrange(GiB))
    asked = rng.randrange(4 * GiB, 12 * GiB)
    times = sorted(rng.uniform(0.1, 5.0) for _ in range(3))
    for t in times:  # the engine yields in three rounds, together enough
        dev.frees[t] = asked // 3 + PIECE
    reply = hog.take(asked, timeout_s=10.0)
    assert reply["complete"] is True and reply["got"] == asked == hog.taken_bytes
    # Done right after the last round freed enough: within one retry.
    assert times[-2] - RETRY_S < reply["seconds"] <= times[-1] + RETRY_S
    assert sum(dev.pieces[-len(hog.taken) :]) == asked and max(dev.pieces) <= PIECE


def test_release_frees_the_take_and_keeps_the_ballast(rng_seed):
    rng = random.Random(rng_seed)
    dev = FakeDevice(32 * GiB)
    hog = dev.hog()
    ballast = hog.ballast(rng.randrange(4 * GiB, 8 * GiB))["ballast"]
    free = dev.free_memory()[0]
    got = hog.take(rng.randrange(GiB, free), timeout_s=0.1)["got"]
    assert dev.free_memory()[0] == free - got
    assert hog.release() == {"released": got, "free": free}
    assert dev.free_memory()[0] == free and hog.ballast_bytes == ballast == dev.used
    assert dev.emptied == 1 and hog.release()["released"] == 0


def test_serve_answers_every_line_until_quit(rng_seed):
    rng = random.Random(rng_seed)
    dev = FakeDevice(16 * GiB)
    asked = rng.randrange(GiB, 2 * GiB)
    lines = [
        json.dumps({"cmd": "ballast", "leave": 4 * GiB}),
        "",
        json.dumps({"cmd": "take", "bytes": asked, "timeout_s": 1}),
        "not json",
        json.dumps({"cmd": "dance"}),
        json.dumps({"cmd": "take"}),  # no size
        json.dumps({"cmd": "release"}),
        json.dumps({"cmd": "quit"}),
        json.dumps({"cmd": "release"}),  # after quit: never read
    ]
    replies: list[dict] = []
    serve(dev.hog(), lines, replies.append)
    assert [next(iter(r)) for r in replies] == [
        "ballast", "got", "error", "error", "error", "released", "quit",
    ]  # fmt: skip
    assert replies[1]["got"] == asked and replies[5]["released"] == asked
    assert "dance" in replies[3]["error"] and "bytes" in replies[4]["error"]


def test_client_drives_the_program_as_a_subprocess(rng_seed):
    rng = random.Random(rng_seed)
    total = rng.randrange(16 * GiB, 64 * GiB)
    hog = VramHog(simulate_bytes=total)
    try:
        ready = hog.start(timeout_s=60)
        assert ready["free"] == ready["total"] == total and ready["pid"] == hog.proc.pid
        leave = rng.randrange(2 * GiB, 8 * GiB)
        reply = hog.ballast(leave)
        assert leave <= reply["free"] < leave + GRAIN
        asked = reply["free"] + rng.randrange(PIECE, 2 * GiB)  # more than is free
        hog.take_async(asked, timeout_s=0.2)
        assert hog.wait_reply(0) is None  # still retrying: the call returned at once
        took = hog.wait_reply(30)
        assert took["complete"] is False and took["got"] == _expected_got(reply["free"], asked)
        assert took["seconds"] >= 0.2
        assert hog.release() == {"released": took["got"], "free": reply["free"]}
    finally:
        hog.close()
    assert hog.proc is None


def test_simulated_device_takes_in_steps_what_the_engine_yields(rng_seed):
    rng = random.Random(rng_seed)
    unit = rng.randrange(1000, 100_000)
    reserve, headroom = rng.randrange(1, 4) * unit, rng.randrange(1, 3) * unit
    engine = {"used": 40 * unit, "floor": 10 * unit}
    dev = SimulatedDevice(200 * unit, lambda: engine["used"])
    dev.ballast(reserve + headroom)
    assert dev.free_memory() == (reserve + headroom, 200 * unit)

    def engine_step() -> None:  # an elastic engine: keeps `reserve` free, down to its floor
        short = reserve - dev.free_memory()[0]
        engine["used"] -= max(0, min(short, engine["used"] - engine["floor"]))

    asked = rng.randrange(headroom + reserve + 1, 25 * unit)
    dev.take_async(asked, timeout_steps=1000)
    assert dev.taken == reserve + headroom  # the first step ran at once: all that was free
    reply, steps = None, 0
    while reply is None:
        engine_step()
        reply = dev.wait_reply()
        steps += 1
    assert reply["complete"] is True and reply["got"] == asked == dev.taken
    assert reply["steps"] == steps + 1 and dev.wait_reply() is None  # one reply per take
    # The engine gave a reserve per round, as many rounds as the take needed, no more.
    given = 40 * unit - engine["used"]
    assert given % reserve == 0 and 0 <= given - (asked - reserve - headroom) < reserve
    assert dev.release() == {"released": asked, "free": reserve + headroom + given}


def test_simulated_device_take_ends_incomplete_beside_a_fixed_engine(rng_seed):
    rng = random.Random(rng_seed)
    unit = rng.randrange(1000, 100_000)
    dev = SimulatedDevice(100 * unit, lambda: 50 * unit)  # a fixed split never yields
    leave = rng.randrange(1, 10) * unit
    dev.ballast(leave)
    timeout = rng.randrange(2, 50)
    dev.take_async(leave + unit, timeout_steps=timeout)
    replies = [dev.wait_reply() for _ in range(timeout + 3)]
    (reply,) = [r for r in replies if r is not None]
    assert reply["complete"] is False and reply["got"] == leave and reply["steps"] == timeout
    assert dev.free_memory()[0] == 0
    assert dev.release()["released"] == leave and dev.free_memory()[0] == leave
