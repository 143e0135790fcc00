"""The CPU branch of a layer's misses, and the online bandwidth estimates q* is computed from.

The misses a policy leaves in the pool run on the CPU while the fills cross the link: the
layer's activations are staged to host memory (started before the fills are issued), the
SIMD expert kernel reads the pool directly, and its partial sum goes back to the device to be
added to the slots' part. Each run and each finished fill is folded into the bank's B_H and
B_P estimates (calibration.update), so q* follows what the link and the CPU deliver now.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable

import numpy as np
import torch

from freetoken_agent.engine.experts import calibration
from freetoken_agent.engine.experts.cache import ExpertCache
from freetoken_agent.engine.experts.policy import Bandwidths, cpu_cost
from freetoken_agent.engine.experts.pool import ExpertPool

# T tokens, K choices, H hidden

SET_LOOKUP_PAIRS = 64  # up to this many (token, choice) pairs, a Python set beats numpy


def stage_hidden(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """Start copying the activations [T, H] to pinned host memory; returns (host tensor,
    ready event; None on a CPU device, where the tensor is the input)."""
    if hidden.device.type != "cuda":
        return hidden, None
    host = torch.empty(hidden.shape, dtype=hidden.dtype, pin_memory=True)
    host.copy_(hidden, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event


def run_on_cpu(
    pool: ExpertPool,
    bandwidths: Bandwidths,
    hidden: torch.Tensor,  # [T, H] on the host
    lids: torch.Tensor,  # [T, K] on the host
    topk_weights: torch.Tensor,  # [T, K] on the host
    on_cpu: list[int],
    timed: bool,
    into: torch.Tensor | None = None,
    source: str = "decode",
) -> torch.Tensor:
    """The pairs whose expert stays in the pool, computed from the pool on the CPU (on the
    calling thread: its OpenMP team is the one torch's CPU ops share and keep warm; from a
    fresh thread the same kernel ran 3x slower on the H200 host). `timed`: fold the run into
    B_H (on CUDA; a CPU "device" has no second branch to balance), as `source` ("decode" or
    "prompt": Bandwidths.cpu_seen). Returns [T, H] on the host: `into` when given
    (calibration.cpu_experts)."""
    # [T, K] pool rows, -1 where the expert is not this branch's. A set lookup per pair: on a
    # decode step's 8-32 pairs np.isin + np.where took 20-40 us, this 5-10 (dev box); a
    # prefill chunk placed expert by expert has thousands of pairs: at 4096 the list took
    # 0.8 ms a layer, numpy 40 us.
    if lids.numel() <= SET_LOOKUP_PAIRS:
        keep = set(on_cpu)
        flat = [lid if lid in keep else -1 for lid in lids.reshape(-1).tolist()]
        rows = torch.tensor(flat, dtype=torch.int64).view(lids.shape)
        served = Counter(lid for lid in flat if lid >= 0).values() if timed else ()
    else:
        ids = lids.numpy() if lids.dtype == torch.int64 else lids.long().numpy()
        kept = np.isin(ids, on_cpu)
        rows = torch.from_numpy(np.where(kept, ids, -1))
        served = np.unique(ids[kept], return_counts=True)[1].tolist() if timed else ()
    start = time.perf_counter()
    part = calibration.cpu_experts(hidden, pool.w13, pool.w2, rows, topk_weights, into=into)
    if timed:
        seconds = time.perf_counter() - start
        calibration.observe_cpu(bandwidths, source, read_bytes(pool, served, bandwidths),
                                seconds)  # fmt: skip
    return part


def read_bytes(pool: ExpertPool, served: Iterable[int], bandwidths: Bandwidths) -> float:
    """The bytes a CPU run counts for B_H: each expert's weights once per `cpu_cost` read of
    them (`served`: the tokens each expert of the run served). Past the knee the kernel is
    bound by arithmetic and q* (policy.split_count) prices such an expert at tokens / knee
    reads, so its observation counts the same. Counted as one read, a prompt chunk's CPU runs
    (tens of tokens an expert) read as 8-25 GB/s on the H200 host against ~90 at decode
    (bench/results/cpu_runs_probe_summary_s31.json), so every prompt left decode's q* with a
    B_H several times too low, and a low B_H sends the CPU too little work to be corrected."""
    return pool.expert_bytes * sum(cpu_cost(t, bandwidths.knee) for t in served)


def observe_fills(cache: ExpertCache, bandwidths: Bandwidths) -> None:
    """Fold the cache's finished fills into the B_P estimate."""
    timings = cache.fill_timings
    done = [f for f in timings if f[1].query()]
    for start, end, nbytes in done:
        seconds = start.elapsed_time(end) / 1e3
        bandwidths.pcie = calibration.update(bandwidths.pcie, nbytes, seconds)
    cache.fill_timings = [f for f in timings if f not in done]
