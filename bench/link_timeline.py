"""Where a profiled window's link time goes: the host-to-device copies of a chrome trace
(torch.profiler's `export_chrome_trace`) merged into busy spans, and every idle gap between
them classed by why the next copy had not started.

- `host late`: the next copy's runtime call (cudaMemcpyAsync) came after the link went idle:
  the host had not queued it yet (its enqueue, or a host wait, sets the pace).
- `device wait`: the copy was queued before the gap opened and waited on the device (the copy
  stream waits for the compute that frees its buffer): the kernels running in the gap say on
  what.

Times in the trace and here are microseconds. Only copies of at least `min_bytes` count as the
link's (the streamer's expert copies; the index lists a layer puts on the device are a few
hundred bytes).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

MIN_BYTES = 1 << 20  # a copy smaller than this is not an expert's (9.4 MB at Qwen3-30B)
GAP_US = 5.0  # idle shorter than this is the copy engine's turnaround, not a stall


@dataclass(frozen=True, slots=True)
class Copy:
    start: float  # device start, us
    end: float
    nbytes: int
    queued: float | None  # host time of its runtime call, us (None: not in the trace)


def trace_events(trace: dict) -> list[dict]:
    """The complete ("X") events of a chrome trace."""
    return [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]


def _correlation(event: dict) -> int | None:
    args = event.get("args") or {}
    value = args.get("correlation", args.get("correlation id"))
    return None if value is None else int(value)


def link_copies(events: list[dict], min_bytes: int = MIN_BYTES) -> list[Copy]:
    """The host-to-device copies of at least `min_bytes`, by device start, each with the host
    time its runtime call was made."""
    queued = {}
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver"):
            c = _correlation(e)
            if c is not None:
                queued[c] = float(e["ts"])
    copies = []
    for e in events:
        name, args = e.get("name", ""), e.get("args") or {}
        if e.get("cat") not in ("gpu_memcpy", "Memcpy") or "HtoD" not in name:
            continue
        nbytes = int(args.get("bytes", 0))
        if nbytes < min_bytes:
            continue
        start = float(e["ts"])
        copies.append(Copy(start, start + float(e.get("dur", 0)), nbytes,
                           queued.get(_correlation(e))))  # fmt: skip
    copies.sort(key=lambda c: c.start)
    return copies


def kernels(events: list[dict]) -> list[tuple[float, float, str]]:
    """(start, end, name) of every device kernel."""
    out = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), e.get("name", "?"))
           for e in events if e.get("cat") == "kernel"]  # fmt: skip
    out.sort()
    return out


def busy_union(spans: list[tuple[float, float]]) -> float:
    """Microseconds covered by at least one of `spans`."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(spans):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def _short(name: str) -> str:
    return name.split("(")[0].split("<")[0][:60]


def link_report(events: list[dict], b_p: float, top: int = 8, min_bytes: int = MIN_BYTES) -> dict:
    """The window from the first to the last device event: before the link's first copy, its
    busy time (and rate beside `b_p`, bytes/s), its gaps by class (the `top` longest with the
    kernels running in them), after its last copy."""
    copies = link_copies(events, min_bytes)
    if not copies:
        return {"error": f"no host-to-device copy of >= {min_bytes} bytes in the trace"}
    ks = kernels(events)
    device_spans = [(c.start, c.end) for c in copies] + [(s, e) for s, e, _ in ks]
    t0 = min(s for s, _ in device_spans)
    t1 = max(e for _, e in device_spans)
    # The link's busy spans: copies merged where they touch or overlap.
    spans: list[list[float]] = []
    for c in copies:
        if spans and c.start <= spans[-1][1] + GAP_US:
            spans[-1][1] = max(spans[-1][1], c.end)
        else:
            spans.append([c.start, c.end])
    busy = sum(e - s for s, e in spans)
    nbytes = sum(c.nbytes for c in copies)
    by_start = {c.start: c for c in copies}
    gaps, classes = [], Counter()
    for (_, g0), (g1, _) in zip(spans, spans[1:], strict=False):
        nxt = by_start[g1]
        late = nxt.queued is not None and nxt.queued > g0
        kind = "host late" if late else "device wait"
        classes[kind] += g1 - g0
        running = Counter()
        for s, e, name in ks:
            if e > g0 and s < g1:
                running[_short(name)] += min(e, g1) - max(s, g0)
        after = None if nxt.queued is None else nxt.queued - g0
        top_kernels = {k: round(v, 1) for k, v in running.most_common(4)}
        gaps.append({"at_ms": (g0 - t0) / 1e3, "us": g1 - g0, "kind": kind,
                     "queued_after_idle_us": after, "kernels_us": top_kernels})  # fmt: skip
    gaps.sort(key=lambda g: -g["us"])
    window = t1 - t0
    return {
        "window_ms": window / 1e3,
        "link_bytes": nbytes,
        "link_limit_ms": nbytes / b_p * 1e3,
        "before_first_copy_ms": (spans[0][0] - t0) / 1e3,
        "link_busy_ms": busy / 1e3,
        "link_rate_gb_s": nbytes / (busy / 1e6) / 1e9,
        "b_p_gb_s": b_p / 1e9,
        "gaps_ms": {k: v / 1e3 for k, v in classes.items()},
        "gap_count": len(gaps),
        "after_last_copy_ms": (t1 - spans[-1][1]) / 1e3,
        "compute_busy_ms": busy_union([(s, e) for s, e, _ in ks]) / 1e3,
        "copies": len(copies),
        "longest_gaps": gaps[:top],
    }
