"""The summaries a `bench offload` decode row carries beside its rate, so a row's mean can be
read without running it again: its steps' times per label (adaptive's step path, `~` while its
trials measure: the steps a row pays for measuring) and per position in a trial block, the B_H
observations behind its online CPU bandwidth (where a low one came from), and the CPU worker's
share and jobs. The labels and seconds are offload_decode.py's timed window's.
"""

from __future__ import annotations

import statistics


def step_times_summary(labels: list[str], seconds: list[float]) -> dict:
    """Per label, the steps' count, mean, median, 90th percentile and longest ms, and the
    label's share of the window's time: whether a row's mean step sits at its trials' median
    (a steady path) or above it (the trials' own blocks, or a tail of slow steps)."""
    total = sum(seconds) or 1.0
    by_label: dict[str, list[float]] = {}
    for label, s in zip(labels, seconds, strict=True):
        by_label.setdefault(label, []).append(1e3 * s)
    out = {}
    for label, ms in by_label.items():
        ranked = sorted(ms)
        out[label] = {"n": len(ms), "mean_ms": statistics.fmean(ms),
                      "median_ms": statistics.median(ms),
                      "p90_ms": ranked[min(len(ms) - 1, int(0.9 * len(ms)))],
                      "max_ms": ranked[-1], "time_share": sum(ms) / 1e3 / total}  # fmt: skip
    return out


def trial_positions(labels: list[str], seconds: list[float]) -> dict:
    """Per trial label (`~`), the median ms of the steps at each position of its blocks (runs
    of one label): whether a block's later steps still pay for the path before it (the cache
    it inherits) or only its first does. Under overlap scheduling the interval at a block's
    position 0 is mostly the last step of the block before (offload_decode.py's `_intervals`)."""
    by_position: dict[str, list[list[float]]] = {}
    run = 0
    for i, (label, s) in enumerate(zip(labels, seconds, strict=True)):
        run = run + 1 if i and labels[i - 1] == label else 0
        if label.endswith("~"):
            at = by_position.setdefault(label, [])
            if run == len(at):  # (a run reaches each position after the ones before it)
                at.append([])
            at[run].append(1e3 * s)
    return {label: [statistics.median(ms) for ms in at] for label, at in by_position.items()}


def cpu_seen_summary(seen) -> dict:
    """The row's B_H observations (Bandwidths.cpu_seen) per source: how many, their median
    and lowest GB/s, how many fell below 10 GB/s, and the median run's MB (one expert of the
    30B shape is 9.4): where an online B_H far below the host's bandwidth came from."""
    by_source: dict[str, list[tuple[float, float]]] = {}
    for source, nbytes, seconds in seen:
        by_source.setdefault(source, []).append((nbytes / seconds / 1e9, nbytes / 1e6))
    return {source: {"n": len(obs), "median_gb_s": statistics.median(g for g, _ in obs),
                     "min_gb_s": min(g for g, _ in obs),
                     "below_10_gb_s": sum(g < 10 for g, _ in obs),
                     "median_mb": statistics.median(mb for _, mb in obs)}
            for source, obs in by_source.items()}  # fmt: skip


def cpu_share_stats(bank) -> dict | None:
    """The CPU worker's jobs since the engine loaded, the share the plans read now, its cores
    (bank.cpu_share's stats; None without a worker)."""
    share = bank.cpu_share
    return None if share is None else share.stats(bank.cache.on_device.share)
