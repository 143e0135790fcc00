"""From how many tokens a prefill chunk streams whole layers (streaming.py) instead of placing
its misses expert by expert (offload.py), derived from measured bandwidths.

Per MoE layer, a chunk of T tokens routes to each of the E experts a Binomial(T, K/E) number of
tokens. Of the experts it touches, those not in a slot (a share 1 - r) are misses, each S bytes:

- placed (adaptive's split, policy.split_count): the experts serving the most tokens are
  fetched, each S / B_P on the link plus the host's work to issue it (FILL_HOST_S, measured
  47-72 us on the H200 host), while the CPU runs the rest from the pool, each
  cpu_cost(tokens) * S / B_H; the layer waits for the slower branch. Both branches read host
  memory, so the layer takes at least (misses * S) / host read bandwidth when that is known.
- streamed: every non-resident expert of the layer crosses the link, E * (1 - r') * S / B_P,
  behind compute (double buffering), touched or not. r' is the share still resident while the
  chunk streams: its staging ring borrows B * G slots (streaming.py, `lend`), whose experts
  are evicted first. When the ring took whole layers (B * E slots), on the H200 host's peer
  slice (12 layers, 657 slots: r = 0.43, r' = 0.26) a chunk streamed in 188-193 ms at every
  length, the model with r' said 195, with r 151
  (bench/results/stream_threshold_12l_s14_kept.json).

Few tokens touch few experts, each serving few tokens, cheap on the CPU: placing wins. Many
tokens touch every expert, each serving many tokens, where the CPU is bound by arithmetic:
placing degenerates into fetching every miss one by one, which streaming does in whole layers
behind compute. The threshold is the smallest T at which streaming is no slower. The GPU's own
compute is left out of both (under a millisecond a layer at the chunk sizes where the two
cross on the H200, and streamed chunks overlap it); so is the cache churn, which both paths
cause (fills evict; the slots streaming lends are counted above, while it streams).

Counts are the Binomial's quantiles (no sampling): expert i serves the (i + 1/2)/E quantile.
"""

from __future__ import annotations

import math

from freetoken_agent.engine.experts.policy import Bandwidths, balance, cpu_cost

FILL_HOST_S = 60e-6  # host time to issue one expert's fill (two copies, bookkeeping; H200 host)
STEP = 16  # thresholds are searched in steps of this many tokens
MAX_TOKENS = 1 << 15  # past this, stream (a layer's experts every chunk is the cheaper bound)


def binomial_quantiles(n: int, p: float, count: int) -> list[int]:
    """The (i + 1/2)/count quantiles of Binomial(n, p), i = 0..count-1, largest first."""
    if p >= 1 or p <= 0:  # every token on every expert (top-k of all), or none
        return [n if p >= 1 else 0] * count
    targets = [(i + 0.5) / count for i in range(count)]
    out, cdf, k = [], 0.0, 0
    log_q = math.log1p(-p)
    log_pmf = n * log_q  # P(X = 0)
    for t in targets:  # ascending targets: walk the CDF once
        while k < n and cdf + math.exp(log_pmf) < t:
            cdf += math.exp(log_pmf)
            log_pmf += math.log(n - k) - math.log(k + 1) + math.log(p) - log_q
            k += 1
        out.append(k)
    return sorted(out, reverse=True)


def placed_seconds(tokens: list[int], expert_bytes: int, bw: Bandwidths,
                   host_read: float | None) -> float:  # fmt: skip
    """A layer's time placing misses that serve `tokens` tokens each (most first): the first
    q fetched, the rest on the CPU, q chosen to minimise the slower branch."""
    fetch = expert_bytes / bw.pcie + FILL_HOST_S
    cpu = [cpu_cost(t, bw.knee) * expert_bytes / bw.cpu for t in tokens]
    best = balance(fetch, cpu)[1]
    if host_read:
        best = max(best, len(tokens) * expert_bytes / host_read)
    return best


def layer_seconds(
    tokens: int,
    n_experts: int,
    top_k: int,
    expert_bytes: int,
    bw: Bandwidths,
    resident: float,
    host_read: float | None = None,
    staging: float = 0.0,
) -> tuple[float, float]:
    """(streamed, placed): one layer's time for a chunk of `tokens` tokens, with a share
    `resident` of the layer's experts in slots, of which a share `staging` of all experts is
    lent to a streamed chunk's staging ring (its experts evicted while it streams)."""
    missing = max(1, round(n_experts * (1 - resident)))  # non-resident experts a layer
    # The non-resident experts take counts spread evenly over the layer's quantiles.
    counts = binomial_quantiles(tokens, top_k / n_experts, n_experts)
    spread = [counts[int((j + 0.5) * n_experts / missing)] for j in range(missing)]
    placed = [c for c in spread if c > 0]  # untouched experts are no miss
    streamed_missing = max(1, round(n_experts * (1 - max(0.0, resident - staging))))
    return (
        streamed_missing * expert_bytes / bw.pcie,
        placed_seconds(placed, expert_bytes, bw, host_read),
    )


def stream_threshold(
    n_experts: int,
    top_k: int,
    expert_bytes: int,
    bw: Bandwidths,
    resident: float,
    host_read: float | None = None,
    staging: float = 0.0,
) -> int:
    """The smallest chunk (a multiple of STEP tokens, at most MAX_TOKENS) whose layers stream
    no slower than they are placed, with a share `resident` of each layer's experts in slots
    (`staging`: the share lent to a streamed chunk, layer_seconds)."""

    def streams(t: int) -> bool:
        streamed, placed = layer_seconds(t, n_experts, top_k, expert_bytes, bw, resident,
                                         host_read, staging)  # fmt: skip
        return streamed <= placed

    # Placing only slows as chunks grow (more experts touched, more tokens each): bisect for
    # the first step that streams (a dozen evaluations, not thousands at load).
    lo, hi = 1, MAX_TOKENS // STEP  # in steps; streams(hi * STEP) is assumed
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if streams(mid * STEP) else (mid + 1, hi)
    return lo * STEP
