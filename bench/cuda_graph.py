"""Capturing a benchmark step in a CUDA graph, the way the engine's decode runs.

The step runs once on a side stream first (Triton compiles and autotunes outside the capture),
then is captured with Python's collector off: a collection inside the capture that destroys an
earlier graph (cudaGraphExecDestroy, not allowed while a stream captures) invalidates it (seen
on the H200, bench plan-kernel). The returned callable replays it; `device_ms` times a replay.
"""

from __future__ import annotations

import gc
from collections.abc import Callable

import torch


def captured(step: Callable[[], object]) -> Callable[[], None]:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile and warm up off the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    gc.collect()
    gc.disable()
    try:
        with torch.cuda.graph(graph):
            step()
    finally:
        gc.enable()
    return graph.replay


def device_ms(run: Callable[[], object]) -> float:
    """Device time of the work `run` queues on the current stream, in ms (CUDA events around
    it; waits for the end)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def rotated_times(replays: dict[str, Callable[[], None]], rounds: int,
                  per: int = 1) -> dict[str, list[float]]:  # fmt: skip
    """Each replay's median device time (triton's do_bench, ms) divided by `per` (the layers a
    replay holds), once a round; the rows take turns in a rotated order each round, since the
    device host's speed drifts over seconds."""
    from triton.testing import do_bench

    names = list(replays)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name].append(do_bench(replays[name], return_mode="median") / per)
    return times


def rows_beside_copy(times: dict[str, list[float]], nbytes: int, hbm: float,
                     label: str = "") -> dict[str, dict]:  # fmt: skip
    """Each row's median of `times` (ms a layer, rotated_times'), as us a layer, the GB/s of
    the `nbytes` a layer reads and their share of the copy bandwidth `hbm` (bytes/s), printed
    after `label`; the JSON rows."""
    rows = {}
    for name, ms in times.items():
        best = sorted(ms)[len(ms) // 2]
        gbps = nbytes / best / 1e6
        rows[name] = {"us_per_layer": 1e3 * best, "gb_s": gbps, "of_copy": gbps / (hbm / 1e9),
                      "rounds_us": [1e3 * t for t in ms]}  # fmt: skip
        print(f"{label}{name:44s} {1e3 * best:7.2f} us a layer  {gbps:6.0f} GB/s  "
              f"{100 * gbps / (hbm / 1e9):3.0f}% of copy", flush=True)  # fmt: skip
    return rows
