"""bench/link_timeline.py on synthetic chrome traces: busy time, gaps and their classes as the
trace was built."""

from __future__ import annotations

import random

import pytest

from freetoken_agent.bench.link_timeline import GAP_US, MIN_BYTES, link_report, trace_events


def synthetic_trace(rng: random.Random):
    """A trace of copies with random gaps, each gap's next copy queued before the gap (device
    wait, a kernel running in it) or after (host late); returns (trace, expected)."""
    events, t = [], 1000.0 + rng.uniform(0, 100)
    copy = "Memcpy HtoD (Pinned -> Device)"
    start_kernel = rng.uniform(10, 50)  # a kernel before the first copy
    events.append({"ph": "X", "cat": "kernel", "name": "embed", "ts": t - start_kernel,
                   "dur": start_kernel / 2})  # fmt: skip
    expected = {"host late": 0.0, "device wait": 0.0, "busy": 0.0, "bytes": 0, "gaps": 0}
    n = rng.randint(5, 30)
    for i in range(n):
        dur, nbytes = rng.uniform(50, 500), rng.randint(MIN_BYTES, 20 * MIN_BYTES)
        if i:
            gap = rng.uniform(2 * GAP_US, 300)
            late = rng.random() < 0.5
            queued = t + rng.uniform(1, gap - 1) if late else t - rng.uniform(1, 200)
            if not late:  # the compute it waited for runs in the gap
                events.append({"ph": "X", "cat": "kernel", "name": f"moe_{i}(int)", "ts": t,
                               "dur": gap})  # fmt: skip
            expected["host late" if late else "device wait"] += gap
            expected["gaps"] += 1
            t += gap
        else:
            queued = t - 5
        events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpyAsync", "ts": queued,
                       "dur": 3, "args": {"correlation": i}})  # fmt: skip
        events.append({"ph": "X", "cat": "gpu_memcpy", "name": copy, "ts": t, "dur": dur,
                       "args": {"correlation": i, "bytes": nbytes}})  # fmt: skip
        # A small index copy beside it: not the link's.
        events.append({"ph": "X", "cat": "gpu_memcpy", "name": copy, "ts": t + 1, "dur": 1,
                       "args": {"correlation": 10_000 + i, "bytes": 512}})  # fmt: skip
        expected["busy"] += dur
        expected["bytes"] += nbytes
        t += dur
    tail = rng.uniform(10, 100)
    events.append({"ph": "X", "cat": "kernel", "name": "lm_head", "ts": t, "dur": tail})
    expected["after"] = tail
    expected["before"] = start_kernel
    rng.shuffle(events)
    return {"traceEvents": events + [{"ph": "M", "name": "process_name"}]}, expected


@pytest.mark.parametrize("trial", range(5))
def test_link_report_matches_the_built_trace(rng_seed, trial):
    rng = random.Random(rng_seed + trial)
    trace, want = synthetic_trace(rng)
    b_p = rng.uniform(20e9, 60e9)
    got = link_report(trace_events(trace), b_p)
    assert got["link_bytes"] == want["bytes"]
    assert got["link_busy_ms"] == pytest.approx(want["busy"] / 1e3, rel=1e-9)
    assert got["link_limit_ms"] == pytest.approx(want["bytes"] / b_p * 1e3)
    assert got["gap_count"] == want["gaps"]
    for kind in ("host late", "device wait"):
        assert got["gaps_ms"].get(kind, 0.0) == pytest.approx(want[kind] / 1e3, abs=1e-9)
    assert got["before_first_copy_ms"] == pytest.approx(want["before"] / 1e3)
    assert got["after_last_copy_ms"] == pytest.approx(want["after"] / 1e3)
    total = (got["before_first_copy_ms"] + got["link_busy_ms"] + sum(got["gaps_ms"].values())
             + got["after_last_copy_ms"])  # fmt: skip
    assert total == pytest.approx(got["window_ms"])
    for gap in got["longest_gaps"]:
        if gap["kind"] == "device wait":  # the compute it waited on is named
            assert any(k.startswith("moe_") for k in gap["kernels_us"]), gap
    lengths = [g["us"] for g in got["longest_gaps"]]
    assert lengths == sorted(lengths, reverse=True)


def test_no_link_copy_is_reported_not_raised():
    trace = {"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": 0, "dur": 5}]}
    assert "no host-to-device copy" in link_report(trace_events(trace), 50e9)["error"]
