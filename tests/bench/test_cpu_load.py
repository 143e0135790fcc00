"""bench/cpu_load.py: a window's cores, split between this process's threads, the rest of the
machine and the hypervisor's steal."""

from __future__ import annotations

import os
import random
import sys
import threading
import time

import pytest

from freetoken_agent.bench import cpu_load

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def test_a_window_splits_the_cores_between_this_process_others_and_steal(rng_seed):
    """Exact arithmetic from two snapshots: ticks over the tick rate and the window."""
    rng = random.Random(rng_seed)
    tick = os.sysconf("SC_CLK_TCK")
    seconds = rng.uniform(0.2, 5.0)
    busy0, steal0, proc0 = (rng.randrange(10**9) for _ in range(3))
    proc_d, others_d, steal_d = (rng.randrange(1, 4 * tick) for _ in range(3))
    names = {tid: f"t{tid}" for tid in rng.sample(range(100, 10**6), rng.randint(2, 9))}
    before = {tid: (name, rng.randrange(10**6)) for tid, name in names.items()}
    grown = {tid: rng.randrange(1, 2 * tick) for tid in names}
    grown[rng.choice(list(names))] = 0  # idle all the window: not among the busy ones
    after = {tid: (name, before[tid][1] + grown[tid]) for tid, name in names.items()}
    after[1] = ("born during the window", 7)  # not in `before`: left out
    a = cpu_load.Snapshot(10.0, busy0, steal0, proc0, before)
    b = cpu_load.Snapshot(10.0 + seconds, busy0 + proc_d + others_d, steal0 + steal_d,
                          proc0 + proc_d, after)  # fmt: skip
    load = cpu_load.between(a, b, top=len(names))
    assert load.seconds == pytest.approx(seconds)
    assert load.process == pytest.approx(proc_d / tick / seconds)
    assert load.machine == pytest.approx((proc_d + others_d) / tick / seconds)
    assert load.others == pytest.approx(others_d / tick / seconds)
    assert load.steal == pytest.approx(steal_d / tick / seconds)
    want = sorted(((names[t], t, g / tick / seconds) for t, g in grown.items() if g > 0),
                  key=lambda item: -item[2])  # fmt: skip
    assert [(n, t) for n, t, _ in load.busiest_threads] == [(n, t) for n, t, _ in want]
    assert [c for *_, c in load.busiest_threads] == pytest.approx([c for *_, c in want])
    assert len(cpu_load.between(a, b, top=2).busiest_threads) == min(2, len(want))
    report = load.report()
    assert report["process_cores"] == round(load.process, 2)
    assert report["machine_cores"] == round(load.machine, 2)
    assert report["others_cores"] == round(load.others, 2)
    assert report["steal_cores"] == round(load.steal, 2)
    assert report["busiest_threads"] == [[n, t, round(c, 2)] for n, t, c in load.busiest_threads]
    assert cpu_load.between(b, a) is None and cpu_load.between(None, b) is None


def test_a_thread_name_with_parentheses_and_spaces_is_read_whole(rng_seed):
    rng = random.Random(rng_seed)
    utime, stime = rng.randrange(10**6), rng.randrange(10**6)
    fields = ["S"] + [str(rng.randrange(1000)) for _ in range(10)] + [str(utime), str(stime)]
    fields += [str(rng.randrange(1000)) for _ in range(20)]
    line = f"{rng.randrange(1, 10**6)} (a (b) c) " + " ".join(fields)
    assert cpu_load._ticks_of_stat(line) == ("a (b) c", utime + stime)


def test_no_proc_gives_no_load(tmp_path):
    assert cpu_load.snapshot(tmp_path) is None


@linux
def test_a_spinning_thread_of_this_process_shows_while_the_caller_sleeps():
    """What the offload bench samples before each host probe: a thread left spinning is named,
    with about a core; with it stopped, no thread of the process is near one."""
    stop, tid = threading.Event(), []

    def spin() -> None:
        tid.append(threading.get_native_id())
        while not stop.is_set():
            pass

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    try:
        while not tid:
            time.sleep(0.001)
        load = cpu_load.sample(0.5)
    finally:
        stop.set()
        thread.join()
    busiest = {t: cores for _, t, cores in load["busiest_threads"]}
    # About a core, or on a machine other processes load (a shared CI box: load averages of
    # 7-10 on 2 cores failed a fixed 0.5) at least half of what they leave of one core.
    free = min(1.0, (os.cpu_count() or 1) - load["others_cores"] - load["steal_cores"])
    assert busiest.get(tid[0], 0.0) > 0.5 * max(free, 0.1), load
    assert max(busiest, key=busiest.get) == tid[0], load  # and it is this process's busiest
    # (the process's, the threads' and the machine's counters are read one after another, in
    # 10 ms ticks: over 0.5 s they agree to a few ticks)
    assert load["process_cores"] >= busiest[tid[0]] - 0.25
    assert load["machine_cores"] >= load["process_cores"] - 0.25
    quiet = cpu_load.sample(0.5)
    assert all(cores < 0.3 for *_, cores in quiet["busiest_threads"]), quiet
