"""Which cache misses of a decode step are fetched into GPU slots and which run on the CPU.

The model (DESIGN section 1, idea 2). A step of one MoE layer misses m experts of S_e bytes each.
Fetching q of them costs q * S_e / B_P on the PCIe link (pinned host-to-device bandwidth), then
negligible GPU time; running the other m - q on the CPU from the pool costs (m - q) * S_e / B_H,
where B_H is the CPU executor's expert throughput (bytes of weights it streams per second at a
few tokens). The two branches run concurrently, so the layer waits for the slower:

    t(q) = max(q * S_e / B_P, (m - q) * S_e / B_H),   minimised at  q* = m * B_P / (B_P + B_H)

rounded to the nearest integer. As B_H -> 0 every miss is fetched (the `transfer` policy); as
B_P -> 0 every miss runs on the CPU (`cpu`). Fetched experts also stay cached for later steps,
which the model ignores: it favours the CPU branch slightly, which is the right bias when the
routing has little temporal locality and fills would mostly evict experts that were about to
hit. Both bandwidths are measured (`freetoken calibrate`) and re-estimated online from observed
timings; the policy only sees the current estimates.

`adaptive` applies q* with one correction: a fill evicts an expert and keeps the new one, which
pays only when routing asks for the new one before the victim. The cache measures that race
(`ExpertCache.fill_gain`); adaptive fetches every miss when fills win it (temporal locality),
splits by q* when neither does (near-uniform routing), and fetches none when victims win
(thrashing). Free slots are always filled (see `OffloadedExpertBank._adaptive_fetches`).
"""

from __future__ import annotations

from dataclasses import dataclass

OFFLOAD_POLICIES = ("adaptive", "transfer", "cpu", "static")


@dataclass(slots=True)
class Bandwidths:
    """Current estimates in bytes/s. Defaults stand in until a calibration exists: equal
    speeds split misses evenly."""

    pcie: float = 25e9  # B_P
    cpu: float = 25e9  # B_H


def fetch_count(policy: str, misses: int, bw: Bandwidths) -> int:
    """How many of `misses` experts to fetch into slots (the rest run on the CPU)."""
    if misses <= 0 or policy in ("cpu", "static"):
        return 0
    if policy == "transfer":
        return misses
    if policy == "adaptive":
        return min(misses, max(0, round(misses * bw.pcie / (bw.pcie + bw.cpu))))
    raise ValueError(f"unknown offload policy {policy!r}")
