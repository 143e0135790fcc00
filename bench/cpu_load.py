"""Who used the host's cores over a window: this process's threads, the rest of the machine, and
the hypervisor (steal), from /proc.

The CPU worker's share of a decode step is only as fast as the cores it gets. On the H200 host
(twenty-seventh session) the CPU expert kernel probed 65-78 GB/s at a run's start and 7.7-14
GB/s after its routing regimes had run, while the uniform rows' worker measured 58 GB/s online
against 81-94 the session before: something took the cores, and the run could not say whether
it was a thread of this process left spinning (a bug here), another tenant of the machine, or
the hypervisor. A window's `CpuLoad` says which, in cores (1.0 = one core busy all the window).
Linux only: elsewhere `sample` returns None and the reports say so.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

# /proc/stat's "cpu" line: user nice system idle iowait irq softirq steal (guest time is
# already inside user and nice).
_BUSY_FIELDS = (0, 1, 2, 5, 6)  # user nice system irq softirq
_STEAL_FIELD = 7


@dataclass(frozen=True)
class Snapshot:
    when: float  # time.perf_counter()
    machine_busy: int  # ticks, all cores, every process
    machine_steal: int  # ticks the hypervisor ran something else on our cores
    process: int  # ticks of this process (utime + stime)
    threads: dict[int, tuple[str, int]]  # tid -> (name, utime + stime ticks)


def _ticks_of_stat(line: str) -> tuple[str, int]:
    """(name, utime + stime) of a /proc/.../stat line; the name may hold spaces and ')'."""
    name = line[line.index("(") + 1 : line.rindex(")")]
    fields = line[line.rindex(")") + 2 :].split()
    return name, int(fields[11]) + int(fields[12])  # fields 14 and 15 of proc(5)


def snapshot(proc: Path = Path("/proc")) -> Snapshot | None:
    """Now's counters, or None where /proc has no stat (not Linux)."""
    try:
        cpu = (proc / "stat").read_text().splitlines()[0].split()[1:]
        process = _ticks_of_stat((proc / "self" / "stat").read_text())[1]
    except (OSError, IndexError, ValueError):
        return None
    threads = {}
    for task in (proc / "self" / "task").iterdir():
        try:  # a thread may end between the listing and the read
            threads[int(task.name)] = _ticks_of_stat((task / "stat").read_text())
        except (OSError, ValueError):
            continue
    values = [int(v) for v in cpu]
    busy = sum(values[i] for i in _BUSY_FIELDS)
    steal = values[_STEAL_FIELD] if len(values) > _STEAL_FIELD else 0
    return Snapshot(time.perf_counter(), busy, steal, process, threads)


@dataclass(frozen=True)
class CpuLoad:
    """A window's average use, in cores."""

    seconds: float
    machine: float  # every process on the machine (this one included)
    process: float  # this process
    others: float  # machine - process: other processes (another tenant, a stray job)
    steal: float  # the hypervisor's: cores we were promised and did not get
    busiest_threads: list[tuple[str, int, float]]  # this process's busiest: (name, tid, cores)

    def report(self) -> dict:
        return {"seconds": round(self.seconds, 3), "machine_cores": round(self.machine, 2),
                "process_cores": round(self.process, 2), "others_cores": round(self.others, 2),
                "steal_cores": round(self.steal, 2),
                "busiest_threads": [[n, tid, round(c, 2)]
                                    for n, tid, c in self.busiest_threads]}  # fmt: skip


def between(a: Snapshot | None, b: Snapshot | None, top: int = 6) -> CpuLoad | None:
    """The load from snapshot `a` to the later `b` (None if either is)."""
    if a is None or b is None or b.when <= a.when:
        return None
    tick, seconds = os.sysconf("SC_CLK_TCK"), b.when - a.when

    def cores(ticks: int) -> float:
        return ticks / tick / seconds

    machine, process = cores(b.machine_busy - a.machine_busy), cores(b.process - a.process)
    per_thread = [(name, tid, cores(t - a.threads[tid][1]))
                  for tid, (name, t) in b.threads.items()
                  if tid in a.threads and t > a.threads[tid][1]]  # fmt: skip
    per_thread.sort(key=lambda item: -item[2])
    return CpuLoad(seconds, machine, process, max(0.0, machine - process),
                   cores(b.machine_steal - a.machine_steal), per_thread[:top])  # fmt: skip


def sample(seconds: float) -> dict | None:
    """The load over the next `seconds` of this thread sleeping: threads of this process busy
    in it are spinning while nothing is asked of them."""
    a = snapshot()
    time.sleep(seconds)
    load = between(a, snapshot())
    return None if load is None else load.report()
