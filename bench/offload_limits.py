"""`bench offload`'s limits and prefill: each figure beside the bound that bandwidths measured
in the same run put on it (DESIGN section 7), and the run's closing lines.

A decode step >= (resident bytes read) / B_HBM + (miss bytes) / min(B_P + B_H, host read with
both paths at once), the same for every policy (the machine's limit at the row's miss rate: a
policy that leaves the link or the CPU idle is below it by as much; host_caps.py). A prompt of
n tokens >= its ceil(n / chunk) chunks' bytes streamed over the link (the streamer's count of
the experts not already resident) / B_P. A figure above its limit is named in a WARNING line
(`closing_lines`).
"""

from __future__ import annotations

import time

from freetoken_agent.bench.host_caps import HostCaps, above_limits
from freetoken_agent.bench.offload_decode import sync_device
from freetoken_agent.bench.offload_table import decode_table
from freetoken_agent.engine.experts.offload import WHOLE_STEP_POLICIES
from freetoken_agent.engine.sampling_params import SamplingParams


def add_limits(row: dict, policy: str, batch: int, expert_bytes: float, device_read: float,
               caps: HostCaps, b_hbm: float) -> None:  # fmt: skip
    """A decode row's bytes a step and its limits beside them (host_caps.py): the hits' and
    `device_read` (dense weights, KV) from HBM, the misses from the host. The row's counters
    are per token; a step carries the window's tokens / forward passes of them (`batch` in a
    steady window), so its bytes are a token's times that, and its limit batch / the step's
    floor (HostCaps.bound)."""
    passes = row.get("forward_passes")
    per_step = row["tokens"] / passes if passes else batch
    experts = row["experts_per_token"] * per_step  # a step's distinct (layer, expert) pairs
    miss_bytes = experts * row["miss_rate"] * expert_bytes
    hit_bytes = experts * (1 - row["miss_rate"]) * expert_bytes
    # whole_step (direct, gpu-fill: no CPU branch) is for reading the row; the limit is the
    # machine's and the same for every policy (HostCaps.miss_bandwidth).
    row.update(batch=batch, tokens_per_step=per_step, step_device_bytes=device_read + hit_bytes,
               step_hit_bytes=hit_bytes, step_host_bytes=miss_bytes,
               whole_step=policy in WHOLE_STEP_POLICIES)  # fmt: skip
    caps.bound(row, b_hbm)


def caps_report(caps: HostCaps) -> dict:
    """The report's caps: the best of each (what every limit uses) and every probe."""
    return {"b_p_gb_s": caps.b_p / 1e9, "b_h_gb_s": caps.b_h / 1e9,
            "host_read_gb_s": caps.b_read / 1e9, "host_probes": caps.probes}  # fmt: skip


def timed_prefill(engine, n: int, rng) -> float:
    """Prefill tok/s of one random n-token prompt (max_tokens 1: the prefill and the token it
    samples), the clock between two device syncs; a failed prefill raises rather than give a
    figure."""
    sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    prompt = [rng.randrange(engine.spec.vocab_size) for _ in range(n)]  # (not the engine's work)
    sync_device()
    start = time.perf_counter()
    out = engine.generate(prompt, sp)
    sync_device()
    if out.finish_reason == "error":
        raise RuntimeError(f"prefill of {n} tokens failed: {out.error}")
    return n / (time.perf_counter() - start)


def prefill_limit(n: int, chunk: int, b_p: float, chunk_bytes: float) -> float:
    """The streaming limit of an n-token prompt in tok/s (DESIGN section 7): each of its
    ceil(n / chunk) chunks streams every layer, so it moves `chunk_bytes` (the experts not
    already resident) over the link at B_P; the last, partial chunk pays as much as a full
    one."""
    return n / (-(-n // chunk) * chunk_bytes / b_p)


def prefill_row(engine, n: int, chunk: int, b_p: float, rng, repeats: int = 1,
                prepare=None) -> dict:  # fmt: skip
    """A timed prefill of n tokens (`timed_prefill`) beside its streaming limit, from the
    bytes that crossed the link while it ran: the streamer's host-to-device copies (resident
    experts are read in their slots) and the cache's fills (a chunk below the streaming
    threshold fills slots instead). With no streamer, or nothing counted, every chunk is taken
    to move the whole pool (`link_bytes_counted` false). `ring_group`: the experts a ring
    buffer held in the last chunk (streaming.py's per-chunk sizing). `repeats` prompts, each
    after `prepare()` (the cache state the row measures), give the median's figures (with an
    even count the slower middle) and every run's tok/s (`tok_s_runs`)."""
    bank = engine.loaded.bank
    streamer = getattr(bank, "streamer", None)

    def moved() -> int:
        _ = bank.stats  # (folds the device path's fills into the cache's count: one sync)
        return getattr(streamer, "bytes_h2d", 0) + bank.cache.bytes_filled

    runs = []  # (tok/s, bytes moved)
    for _ in range(repeats):
        if prepare is not None:
            prepare()
        before = moved()
        rate = timed_prefill(engine, n, rng)
        runs.append((rate, moved() - before))
    rate, link_bytes = sorted(runs)[(len(runs) - 1) // 2]
    chunks = -(-n // chunk)
    counted = streamer is not None and link_bytes > 0
    chunk_bytes = link_bytes / chunks if counted else bank.pool.nbytes
    limit = prefill_limit(n, chunk, b_p, chunk_bytes)
    return {"tok_s": rate, "limit_tok_s": limit, "of_limit": rate / limit, "chunks": chunks,
            "link_bytes": chunks * chunk_bytes, "link_bytes_counted": counted,
            "ring_group": getattr(streamer, "group", None),
            "tok_s_runs": [r for r, _ in runs]}  # fmt: skip


FILL_BATCH = 256  # lids a cache.fill call of `fill_every_slot` brings in


def fill_every_slot(bank, rng) -> int:
    """Every free slot of `bank`'s cache given a distinct random expert, as a long decode leaves
    them, the copies waited for; returns how many experts are then resident. The prefill rows
    run from an emptied cache, where every expert streams; the `_warm` rows run from this one,
    for issue 3's "the streaming limit of the bytes not already resident" (resident experts
    are read in their slots; the streamer's ring, lent from the slots, evicts a few)."""
    cache = bank.cache
    lids = rng.sample(range(bank.pool.n_rows), cache.free_slots)
    for start in range(0, len(lids), FILL_BATCH):
        cache.fill(lids[start : start + FILL_BATCH], protect=set(), race=False)
    sync_device()
    return sum(cache.resident(lid) for lid in range(bank.pool.n_rows))


def closing_lines(report: dict) -> list[str]:
    """The run's last lines: the decode table, then a WARNING for every decode or prefill
    figure above its limit (host_caps.above_limits)."""
    prefill = {f"prefill {key}": row for key, row in report["prefill"].items()}
    warnings = above_limits(report["decode"]) + above_limits(prefill)
    return decode_table(report["decode"]) + warnings
