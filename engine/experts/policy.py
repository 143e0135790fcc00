"""Which cache misses of a decode step are fetched into GPU slots and which run on the CPU.

The model (DESIGN section 1, idea 2). A step of one MoE layer misses m experts of S_e bytes each.
Fetching q of them costs q * S_e / B_P on the PCIe link (pinned host-to-device bandwidth), then
negligible GPU time; running the other m - q on the CPU from the pool costs (m - q) * S_e / B_H,
where B_H is the CPU executor's expert throughput (bytes of weights it streams per second at a
few tokens). The two branches run concurrently, so the layer waits for the slower:

    t(q) = max(q * S_e / B_P, (m - q) * S_e / B_H),   minimised at  q* = m * B_P / (B_P + B_H)

rounded to the nearest integer. That holds while the CPU branch is bound by reading weights,
i.e. while each missed expert serves few tokens (decode). An expert serving c tokens costs the
CPU about max(1, c / CPU_KNEE_TOKENS) reads' worth of time: past the knee its kernel is bound by
arithmetic (9.4 MFLOP a token for a Qwen3-30B expert against ~0.5 TFLOP/s on 16 cores, beside
one 9.4 MB read at ~60 GB/s: equal near 8 tokens). Chunks too short to stream (below
`stream_min_tokens`) but past the knee (an agent's re-prefill of a few hundred tokens: ~20
tokens per expert) would run 2-10x slower on the CPU than fetched; `split_count` then
minimises the same max over the per-expert costs, fetching the experts with most tokens first.
As B_H -> 0 every miss is fetched (the `transfer` policy); as
B_P -> 0 every miss runs on the CPU (`cpu`). Fetched experts also stay cached for later steps,
which the model ignores: it favours the CPU branch slightly, which is the right bias when the
routing has little temporal locality and fills would mostly evict experts that were about to
hit. Both bandwidths are measured (`freetoken calibrate`) and re-estimated online from observed
timings; the policy only sees the current estimates.

`adaptive` applies q* with one correction: a fill evicts an expert and keeps the new one, which
pays only when routing asks for the new one before the victim. The cache measures that race
(`ExpertCache.fill_gain`); adaptive fetches every miss when fills win it (temporal locality),
fetches none when victims win (thrashing), and when neither does (near-uniform routing) runs
q*, fetch-all, fetch-none or whole layers, whichever measured the shortest decode steps
(split_trials.py). Free slots are always filled (see adaptive.py).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

# direct: direct.py; gpu-fill: device_fills.py
OFFLOAD_POLICIES = ("adaptive", "transfer", "cpu", "static", "direct", "gpu-fill")
# Policies whose decode may run the device path (device_path.py): its fills, its pins.
DEVICE_PATH_POLICIES = ("gpu-fill", "adaptive")
# Policies whose decode step is one graph: nothing in it waits for the host.
WHOLE_STEP_POLICIES = ("direct", "gpu-fill")


CPU_KNEE_TOKENS = 8  # tokens per expert where the CPU kernel turns compute-bound (H200 host)


CPU_SEEN = 512  # B_H observations Bandwidths keeps for diagnosis


@dataclass(slots=True)
class Bandwidths:
    """Current estimates in bytes/s. Defaults stand in until a calibration exists: equal
    speeds split misses evenly."""

    pcie: float = 25e9  # B_P
    cpu: float = 25e9  # B_H
    # Tokens per expert past which the CPU kernel is bound by arithmetic, not by reading the
    # weights (`freetoken calibrate` measures it: fewer cores or narrower vectors lower it).
    knee: float = CPU_KNEE_TOKENS
    # The latest B_H observations as (source, bytes, seconds), newest last; sources "decode"
    # and "prompt" (the stops path's CPU runs of decode-sized and longer calls:
    # cpu_branch.py), "worker" (the device path's CPU share: cpu_share.py). A diagnosis, not
    # an input: bench offload's rows summarise them, to say where an estimate that fell far
    # below the host's bandwidth came from (calibration.observe_cpu appends).
    cpu_seen: deque = field(default_factory=lambda: deque(maxlen=CPU_SEEN), compare=False)


def cpu_cost(tokens: int, knee: float = CPU_KNEE_TOKENS) -> float:
    """The CPU's time for one expert serving `tokens` tokens, in reads of its weights."""
    return max(1.0, tokens / knee)


def split_count(tokens: list[int], bw: Bandwidths) -> int:
    """`adaptive`'s q for misses serving `tokens` tokens each, most first: the first q are
    fetched. Minimises max(q / B_P, sum of cpu_cost over the rest / B_H) (in expert sizes);
    q* of the module docstring when every expert serves at most `bw.knee` tokens."""
    if all(t <= bw.knee for t in tokens):
        return fetch_count("adaptive", len(tokens), bw)
    return balance(1 / bw.pcie, [cpu_cost(t, bw.knee) / bw.cpu for t in tokens])[0]


def balance(fetch: float, cpu: list[float]) -> tuple[int, float]:
    """Fetch the first q misses (`fetch` each on the link), run the rest on the CPU (`cpu[i]`
    each): the q that minimises the slower branch, and that branch's time."""
    rest = best = sum(cpu)
    best_q = 0
    for q, c in enumerate(cpu, start=1):
        rest -= c
        slower = max(q * fetch, rest)
        if slower < best:
            best_q, best = q, slower
    return best_q, best


def fetch_count(policy: str, misses: int, bw: Bandwidths) -> int:
    """How many of `misses` experts to fetch into slots (the rest run on the CPU)."""
    if misses <= 0 or policy in ("cpu", "static"):
        return 0
    if policy in ("transfer", "gpu-fill"):  # gpu-fill: a chunk too long for its plans
        return misses
    if policy == "adaptive":
        return min(misses, max(0, round(misses * bw.pcie / (bw.pcie + bw.cpu))))
    raise ValueError(f"unknown offload policy {policy!r}")


def cpu_fraction(bw: Bandwidths) -> float:
    """The CPU's share of a layer's misses at q*: (m - q*) / m = B_H / (B_P + B_H), for a
    split the device makes itself, miss by miss (cpu_share.py)."""
    return bw.cpu / (bw.pcie + bw.cpu)


# `adaptive` fetches every miss above FETCH_ALL_GAIN and none (beyond free slots) below
# FETCH_NONE_GAIN, from ExpertCache.fill_gain. Simulated (LRU, 12 layers x 128 experts, top-8,
# every miss filled; tests/engine/experts/test_offload.py): near-uniform routing stays within
# +-0.04 of 0, a drifting working set at 0.91-0.95, four near-uniform tokens a step in 202
# slots (thrashing) at -0.21 to -0.24; the bench's Zipf 1.0 / locality 0.7 trace at 0.57-0.87
# in one token a step and 0.28-0.56 in four (bench/routing_traces.py), where fetching every
# miss measured best on the device.
FETCH_ALL_GAIN = 0.15
FETCH_NONE_GAIN = -0.1
# Hysteresis on the fetch-all side: once fills have paid (gain above FETCH_ALL_GAIN), adaptive
# keeps fetching every miss until the gain falls below FETCH_ALL_HOLD_GAIN. On the peer slice
# under Zipf 1.0 / locality 0.7 at one token the gain dipped into the band now and then; the
# steps there ran misses on the CPU, which then missed again (locality), and adaptive fell 6%
# behind transfer. Near-uniform routing sits within +-0.04 of 0, below the hold.
FETCH_ALL_HOLD_GAIN = 0.05


class FillVerdict:
    """adaptive's reading of the fill race: "all" (fills pay), "band" (neither; SplitTrials
    decides) or "none" (victims win), with the hysteresis above."""

    def __init__(self) -> None:
        self.fills_pay = False

    def __call__(self, gain: float) -> str:
        hold = self.fills_pay and gain > FETCH_ALL_HOLD_GAIN
        self.fills_pay = gain > FETCH_ALL_GAIN or hold
        return "all" if self.fills_pay else "none" if gain < FETCH_NONE_GAIN else "band"
