"""Expert offloading on the device: decode per policy and streamed prefill, beside the limits.

    python -m freetoken_agent.bench offload [--layers 48] [--budget-gb 32] [--decode 48]

Builds a Qwen3-30B-A3B-shaped model (random bf16 weights; experts in a pinned host pool) under
a GPU budget, then: decode at batch 1 and 4 for each policy (cpu, transfer, adaptive, static,
direct, gpu-fill) and routing regime (routing_traces.py), each from an empty cache after the
same warm-up, with miss rate and bytes over PCIe per token (adaptive: its step path and split
mode), in `--rounds` rounds (the median reported; with an even count the lower middle
round); and
prefill of 4k/8k/16k-token prompts streamed in 8k chunks with two staging buffers and with one.
Limits, from bandwidths measured in the same run (DESIGN section 7): a decode step >=
(resident bytes read) / B_HBM + (miss bytes) / min(B_P + B_H, host read with both paths at
once), the same for every policy (the machine's limit at the row's miss rate: a policy that
leaves the link or the CPU idle is below it by as much); a prompt of n tokens >= its
ceil(n / chunk) chunks' bytes streamed over the link (the streamer's count of the experts not
already resident) / B_P. A figure above its limit is named in a WARNING line. Counters are per
decoded token (a step of batch 4 makes 4). Routing is the random router on random weights
("native": it routes consecutive tokens alike) or replayed synthetic routing (uniform, or Zipf
skew with temporal locality: routing_traces.py).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from freetoken_agent.bench import cpu_load
from freetoken_agent.bench.decode_baseline import kv_bytes_per_token
from freetoken_agent.bench.environment import ENVIRONMENT
from freetoken_agent.bench.host_caps import HostCaps, above_limits
from freetoken_agent.bench.kernel_variants import kernel_variant, measured_variants
from freetoken_agent.bench.limits import hbm_copy_bandwidth, host_read_bandwidth
from freetoken_agent.bench.offload_table import decode_table
from freetoken_agent.bench.random_model import QWEN3_30B_A3B, peer_slice, random_engine
from freetoken_agent.bench.routing_traces import Regime, TracedRouting, TraceGenerator
from freetoken_agent.engine.config import POPULAR_PINS
from freetoken_agent.engine.experts import calibration, step_paths
from freetoken_agent.engine.experts.cpu_share import job_summary
from freetoken_agent.engine.experts.offload import WHOLE_STEP_POLICIES, decode_graph_kind
from freetoken_agent.engine.experts.policy import DEVICE_PATH_POLICIES
from freetoken_agent.engine.experts.split_trials import BLOCK, MODES, ROTATIONS
from freetoken_agent.engine.experts.streaming import LayerStreamer
from freetoken_agent.engine.sampling_params import SamplingParams

RESULTS = Path(__file__).resolve().parent / "results"
POLICIES = ("cpu", "transfer", "adaptive", "static", "direct", "gpu-fill")
# Decode steps before the timed ones: the cache fills, and adaptive measures its step paths
# (step_paths.py) and its split modes once (every mode for BLOCK steps, ROTATIONS times:
# split_trials.py; on the stops path's steps only). The next measurement comes PERIOD steps
# after the first choice (~50 steps in), twice that when the first choice won clearly: then
# outside the peer slice's 256 timed tokens, as outside a user's first reply (a measurement
# inside them cost the uniform peer row 13%, thirty-fourth session).
PATH_STEPS = len(step_paths.PATHS) * step_paths.BLOCK * step_paths.ROTATIONS
WARM_UP = 8 + len(MODES) * BLOCK * ROTATIONS + PATH_STEPS + step_paths.WARM
KV_TOKENS = 32768  # the engine's KV pool and max_model_len


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _use_policy(engine, bank, policy: str, recapture: bool = False) -> None:
    """Switch the offload policy between measurements, recapturing the decode graphs when the
    new policy decodes with another kind (`decode_graph_kind`), or always with `recapture`
    (the model's expert bank was replaced: graphs call the bank object they were captured
    with)."""
    was = bank.policy
    bank.policy = policy
    if policy == "adaptive":
        bank.start_cpu_share()  # (loaded under another policy: its shared path's worker)
    bank.use_popular_pins(engine.config.popular_pins)  # loaded under transfer: none yet
    kinds = {decode_graph_kind(p, bank.device_path_ok) for p in (was, policy)}
    if recapture or (len(kinds) > 1 and engine.runner.graphs is not None):
        engine.capture_graphs()


def start_policy(engine, bank, policy: str, b_p: float, b_h: float,
                 path: str | None = None, shared_gate: bool = True,
                 held_share: float | None = None) -> None:  # fmt: skip
    """Before a measurement: an empty cache, `policy`, the bandwidths measured alone, nothing
    learnt by adaptive (`path`: its step path held, not measured; `shared_gate`: whether
    `shared` waits for the fill race to judge; `held_share`: the shared path's CPU share
    held, not tuned), static's layers placed."""
    bank.cache.reset()
    _use_policy(engine, bank, policy)
    bank.bandwidths.pcie, bank.bandwidths.cpu = b_p, b_h
    bank.bandwidths.cpu_seen.clear()  # the row's own B_H observations (`cpu_seen_summary`)
    bank.reset_decisions()
    bank.adaptive.shared_gate = shared_gate
    bank.adaptive.held_share = held_share
    if path is not None:
        bank.adaptive.path_params = {"fixed": path}
    if policy == "static":
        bank.place_static()


def held_shares(variants: list[tuple], shares: list[float] | None) -> list[tuple]:
    """The rows (name, policy, PDL word, l2, held share): adaptive's once per held share,
    named adaptive~FRACTION; the others, and all without shares, with None."""
    if not shares:
        return [(*v, None) for v in variants]
    rows = []
    for name, policy, word, l2 in variants:
        if policy == "adaptive":
            rows += [(f"{name}~{x:g}", policy, word, l2, x) for x in shares]
        else:
            rows.append((name, policy, word, l2, None))
    return rows


def _decode(engine, n: int, rng, batch: int = 1, context: int = 64) -> tuple[float, dict]:
    """Aggregate decode tok/s of `batch` sequences (after their prefill of `context` tokens
    each) and cache counters, each `*_per_token` per token produced (a step of batch 4 makes
    4; `releases_per_step` per forward pass).

    What the window counts is what it produced: the tokens the requests' outputs grew by and
    the forward passes the runner launched, not `engine.step()` calls. Under overlap
    scheduling (engine/overlap.py) the window's first call only launches a pass and its last
    only reads the pass before: n calls for n - 1 passes, so a rate or a counter per call was
    off by n / (n - 1) (2% at 48 tokens)."""
    bank = engine.loaded.bank
    sp = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    vocab = engine.spec.vocab_size
    rids = [engine.submit([rng.randrange(vocab) for _ in range(context)], sp)
            for _ in range(batch)]  # fmt: skip
    while any(not engine._requests[r].output_ids for r in rids):
        engine.step()
    reserve = getattr(engine.loaded.model.expert_bank, "reserve", None)  # traced routing
    if reserve is not None:  # the traces' draws happen before the clock starts
        reserve(n * batch)
    before = (bank.stats.experts, bank.stats.hits, bank.stats.fetched, bank.stats.on_cpu,
              bank.stats.behind, bank.stats.split, bank.stats.split_hits)  # fmt: skip
    filled0 = bank.cache.bytes_filled
    graphs = engine.runner.graphs
    # Direct graphs never re-run a segment: misses are read in place, so they keep no counter.
    reruns0 = getattr(graphs, "reruns", 0)
    # Segmented graphs: layers that stopped the step for the host, and the host's seconds
    # waiting on segments (the device-bound share of the step).
    stops0, wait0 = getattr(graphs, "missed_layers", 0), getattr(graphs, "wait_s", 0.0)
    releases0 = bank.cache.on_device.releases  # gpu-fill: the cache handed back to the host
    share = getattr(bank, "cpu_share", None)
    _sync()
    # (after the sync: a step still in flight posts its layers' jobs before it ends)
    worker0 = None if share is None else share.counters()
    load_start = cpu_load.snapshot()
    label = _step_labeller(bank, batch)
    labels, ends = [], []
    produced0 = _produced(engine, rids)
    passes0 = engine.runner.launched
    start = time.perf_counter()
    calls = 0
    while engine.has_unfinished():
        labels.append(label())
        engine.step()
        ends.append(time.perf_counter())
        calls += 1
    _sync()
    seconds = time.perf_counter() - start
    intervals = _intervals(start, ends)
    load = cpu_load.between(load_start, cpu_load.snapshot())
    tokens = _produced(engine, rids) - produced0  # (before the requests are collected)
    passes = engine.runner.launched - passes0
    for rid in rids:
        engine._collect(rid)
    st = bank.stats
    experts, hits = st.experts - before[0], st.hits - before[1]
    per_token = 1 / max(tokens, 1)
    return tokens / seconds, {
        "tokens": tokens,  # the window's decoded tokens, all sequences
        "forward_passes": passes,  # decode steps the runner launched in the window
        "engine_calls": calls,  # engine.step() calls (one more than passes under overlap)
        "miss_rate": 1 - hits / experts,
        "fetched_per_token": (st.fetched - before[2]) * per_token,
        "on_cpu_per_token": (st.on_cpu - before[3]) * per_token,
        # of those on the CPU, filled too
        "behind_per_token": (st.behind - before[4]) * per_token,
        # adaptive's split path: fills cut with the CPU, and hits on cut slots still in flight
        # (each posted to the CPU again: the copies behind had not landed)
        "split_per_token": (st.split - before[5]) * per_token,
        "split_hits_per_token": (st.split_hits - before[6]) * per_token,
        "pcie_bytes_per_token": (bank.cache.bytes_filled - filled0) * per_token,
        # A layer's distinct experts count once however many of the step's tokens chose them:
        # at batch B a token's share of them, at most n_moe_layers * top_k.
        "experts_per_token": experts * per_token,
        "segment_reruns_per_token": (getattr(graphs, "reruns", 0) - reruns0) * per_token,
        "stops_per_token": (getattr(graphs, "missed_layers", 0) - stops0) * per_token,
        "wait_ms_per_token": 1e3 * (getattr(graphs, "wait_s", 0.0) - wait0) * per_token,
        # (per step: the rows before the twentieth session called it releases_per_token)
        "releases_per_step": (bank.cache.on_device.releases - releases0) / max(passes, 1),
        # The cores' use over the timed steps: the driver thread and a spinning worker team
        # are this process; others' and steal are cores the worker could not have.
        "cpu_load": None if load is None else load.report(),
        "worker_jobs": None if share is None else _worker_window(worker0, share.counters()),
        "step_ms": step_times_summary(labels, intervals),
        "trial_positions_ms": trial_positions(labels, intervals),
    }


def _produced(engine, rids: list[str]) -> int:
    """Tokens the requests `rids` have produced so far (their outputs' lengths together)."""
    return sum(len(engine._requests[rid].output_ids) for rid in rids)


def _step_labeller(bank, batch: int):
    """() -> the label of the step about to run: adaptive's step path, with `~` while its
    trials measure (the steps a row pays for measuring), or `step` for other policies."""
    if bank.policy != "adaptive":  # (every offloaded bank has `adaptive`, idle elsewhere)
        return lambda: "step"
    paths = bank.adaptive.paths(batch)
    return lambda: paths.current + ("~" if paths.exploring else "")


def _intervals(start: float, ends: list[float]) -> list[float]:
    """Each step's seconds: from the previous step's return (the first: from `start`). Under
    overlap scheduling a call returns once the next step is queued, so in a steady run this
    is the device's step; the last step's wait for the device is outside it. (The interval a
    call measures is then mostly the step the call before launched: at a change of path one
    step can carry its neighbour's label.)"""
    return [end - before for before, end in zip([start, *ends[:-1]], ends, strict=True)]


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
    position 0 is mostly the last step of the block before (`_intervals`)."""
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


def _worker_window(before: dict[str, int], after: dict[str, int]) -> dict:
    """The CPU worker's jobs over the timed steps (cpu_share.py's counters)."""
    return job_summary({name: after[name] - before[name] for name in after})


def _measure(engine, bank, policy: str, batch: int, n: int, rng, b_p: float, b_h: float,
             path: str | None = None, shared_gate: bool = True, context: int = 64,
             held_share: float | None = None) -> dict:  # fmt: skip
    """One policy from an empty cache: WARM_UP decode steps (the cache fills; adaptive's
    first split trials run), then `n` timed. The row: tok/s, counters, online bandwidths."""
    start_policy(engine, bank, policy, b_p, b_h, path, shared_gate, held_share)
    _decode(engine, WARM_UP, rng, batch, context)
    rate, st = _decode(engine, n, rng, batch, context)
    # Elastic memory gives the KV pool's idle pages to slots while decoding: the count at the
    # end, beside the count at load in the report's header.
    row = {"tok_s": rate, **st, "slots": bank.cache.n_slots}
    # Whole layers the stops path's `layers` mode keeps (a layout the device path inherits).
    row["kept_layers"] = len(bank.cache.kept_layers)
    row["b_p_online_gb_s"] = bank.bandwidths.pcie / 1e9
    row["b_h_online_gb_s"] = bank.bandwidths.cpu / 1e9
    row["b_h_seen"] = cpu_seen_summary(bank.bandwidths.cpu_seen)
    pins = bank.popular
    if pins is not None and policy in DEVICE_PATH_POLICIES:  # EngineConfig.popular_pins
        # (one sync: read after the timed steps) how many slots are pinned, how often chosen
        row["pins"] = {"fraction": pins.fraction, "pinned": int(pins.fills.popular.sum()),
                       "choices": pins.choices, "owned_steps": pins.steps}  # fmt: skip
    if policy == "adaptive":
        trials = bank.adaptive.trials(batch)
        row["split_mode"] = trials.chosen if trials.choices else None
        row["split_ms_per_token"] = {m: 1e3 * v for m, v in trials.medians().items()}
        paths = bank.adaptive.paths(batch)
        row["step_path"] = paths.chosen if paths.choices else None
        row["path_ms_per_token"] = {p: 1e3 * v for p, v in paths.medians().items()}
        row["cpu_share"] = cpu_share_stats(bank)
        row["fill_gain"] = bank.cache.fill_gain  # the race adaptive's verdict reads
        split = bank.device_path.split
        if split is not None and row["split_per_token"] > 0:  # the cut it ran last, and the
            row["split_cut"] = split.fills.cut  # cut trials' bias of I
            row["cut_bias"] = bank.adaptive.cuts(batch).bias
    return row


def cpu_share_stats(bank) -> dict | None:
    """The CPU worker's jobs since the engine loaded, the share the plans read now, its cores
    (bank.cpu_share's stats; None without a worker)."""
    share = bank.cpu_share
    return None if share is None else share.stats(bank.cache.on_device.share)


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
               step_host_bytes=miss_bytes, whole_step=policy in WHOLE_STEP_POLICIES)  # fmt: skip
    caps.bound(row, b_hbm)


def caps_report(caps: HostCaps) -> dict:
    """The report's caps: the best of each (what every limit uses) and every probe."""
    return {"b_p_gb_s": caps.b_p / 1e9, "b_h_gb_s": caps.b_h / 1e9,
            "host_read_gb_s": caps.b_read / 1e9, "host_probes": caps.probes}  # fmt: skip


def _median_round(rows: list[dict]) -> dict:
    """The round with the median tok/s (its counters with it), and every round's tok/s. With
    an even count, the lower of the two middle rounds: of 2 rounds, the slower."""
    ranked = sorted(rows, key=lambda row: row["tok_s"])
    return {**ranked[(len(ranked) - 1) // 2], "tok_s_rounds": [row["tok_s"] for row in rows]}


def timed_prefill(engine, n: int, rng) -> float:
    sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    _sync()
    start = time.perf_counter()
    out = engine.generate([rng.randrange(engine.spec.vocab_size) for _ in range(n)], sp)
    _sync()
    if out.finish_reason == "error":
        raise RuntimeError(f"prefill of {n} tokens failed: {out.error}")
    return n / (time.perf_counter() - start)


def prefill_limit(n: int, chunk: int, b_p: float, chunk_bytes: float) -> float:
    """The streaming limit of an n-token prompt in tok/s (DESIGN section 7): each of its
    ceil(n / chunk) chunks streams every layer, so it moves `chunk_bytes` (the experts not
    already resident) over the link at B_P; the last, partial chunk pays as much as a full
    one."""
    return n / (-(-n // chunk) * chunk_bytes / b_p)


def prefill_row(engine, n: int, chunk: int, b_p: float, rng) -> dict:
    """A timed prefill of n tokens (`timed_prefill`) beside its streaming limit, from the
    bytes that crossed the link while it ran: the streamer's host-to-device copies (resident
    experts it copies device to device are not counted) and the cache's fills (a chunk below
    the streaming threshold fills slots instead). With no streamer, or nothing counted, every
    chunk is taken to move the whole pool (`link_bytes_counted` false)."""
    bank = engine.loaded.bank
    streamer = getattr(bank, "streamer", None)

    def moved() -> int:
        _ = bank.stats  # (folds the device path's fills into the cache's count: one sync)
        return getattr(streamer, "bytes_h2d", 0) + bank.cache.bytes_filled

    before = moved()
    rate = timed_prefill(engine, n, rng)
    link_bytes = moved() - before
    chunks = -(-n // chunk)
    counted = streamer is not None and link_bytes > 0
    chunk_bytes = link_bytes / chunks if counted else bank.pool.nbytes
    limit = prefill_limit(n, chunk, b_p, chunk_bytes)
    return {"tok_s": rate, "limit_tok_s": limit, "of_limit": rate / limit, "chunks": chunks,
            "link_bytes": chunks * chunk_bytes, "link_bytes_counted": counted}  # fmt: skip


def closing_lines(report: dict) -> list[str]:
    """The run's last lines: the decode table, then a WARNING for every decode or prefill
    figure above its limit (host_caps.above_limits)."""
    prefill = {f"prefill {key}": row for key, row in report["prefill"].items()}
    warnings = above_limits(report["decode"]) + above_limits(prefill)
    return decode_table(report["decode"]) + warnings


def offload_engine(layers: int, budget_gb: float, chunk: int):
    """(engine, B_P, B_H): the Qwen3-30B-A3B shape cut to `layers`, random weights, experts in
    a pinned host pool under a `budget_gb` GPU budget; both bandwidths measured first."""
    cfg = peer_slice(QWEN3_30B_A3B, layers)
    h, i = cfg["hidden_size"], cfg["moe_intermediate_size"]
    b_p = calibration.measure_pcie(3 * h * i * 2)
    b_h = calibration.measure_cpu(h, i, torch.bfloat16)
    engine = random_engine(
        cfg,
        policy="transfer",
        gpu_budget=int(budget_gb * 1e9),
        kv_tokens=KV_TOKENS,
        max_num_seqs=4,
        max_model_len=KV_TOKENS,
        max_batched_tokens=chunk,
        stream_min_tokens=512,
    )
    return engine, b_p, b_h


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="freetoken bench offload",
        description=__doc__,
        epilog=ENVIRONMENT,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--layers", type=int, default=48,
                        help="model depth (12: peer slice; default: %(default)s)")  # fmt: skip
    parser.add_argument("--budget-gb", type=float, default=32.0,
                        help="GPU budget (GB; default: %(default)s)")  # fmt: skip
    parser.add_argument(
        "--decode", type=int, default=48,
        help="tokens each sequence of a row decodes, the first before the clock starts (its "
        f"prefill's), after WARM_UP ({WARM_UP}) untimed ones (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--context", type=int, default=64, metavar="TOKENS",
        help="prompt tokens of each decoded sequence (agent histories run to 4k-32k; the "
        "limit counts their KV reads; default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--prefill", type=int, nargs="+", default=[4096, 8192, 16384], metavar="TOKENS",
        help="prompt lengths prefilled, double buffer on and off (default: 4096 8192 16384)",
    )  # fmt: skip
    parser.add_argument(
        "--chunk", type=int, default=8192, metavar="TOKENS",
        help="prefill chunk, the engine's max_batched_tokens: a prompt streams the pool once "
        "per chunk (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=RESULTS,
                        help="JSON results folder (default: bench/results)")  # fmt: skip
    parser.add_argument("--skip-decode", action="store_true", help="prefill figures only")
    parser.add_argument("--skip-prefill", action="store_true", help="decode figures only")
    parser.add_argument(
        "--regimes",
        nargs="+",
        default=["native", "uniform", "zipf:1.0,loc:0.7"],
        help="routing: native (the random router as is), uniform, or zipf:S,loc:P (replayed "
        "traces, routing_traces.py: with probability P each of a token's k experts in a layer "
        "repeats one of the previous token's there, else they are drawn without replacement "
        "with P(rank r) ~ 1/r^S over a fixed random ranking per layer; uniform is S = 0, "
        "P = 0; traces seeded 0). Default: native uniform zipf:1.0,loc:0.7 (skew 1.0, "
        "locality 0.7)",
    )
    parser.add_argument(
        "--batches", type=int, nargs="+", default=[1, 4],
        help="decode batches (sequences decoded together; default: 1 4)",
    )  # fmt: skip
    parser.add_argument(
        "--policies", nargs="+", choices=POLICIES, default=list(POLICIES),
        help=f"decode policies (default: all: {' '.join(POLICIES)})",
    )  # fmt: skip
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="decode measurements per policy, each round starting at another policy; the "
        "median round is reported (the device host's speed changes over seconds), with an "
        "even count the lower of the two middle ones: at 2 rounds the slower round "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--fill-behind",
        action="store_true",
        help="adaptive fills some misses behind the layer's compute (EngineConfig.fill_behind; "
        "default off)",
    )
    parser.add_argument(
        "--overlap",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="overlap scheduling: each decode step launched before the last one's tokens are "
        "read (EngineConfig.overlap_schedule; default on, --no-overlap for the plain loop)",
    )
    parser.add_argument(
        "--adaptive-path",
        choices=step_paths.PATHS,
        default=None,
        help="hold adaptive's decode step path instead of measuring them (default: measured, "
        "step_paths.py): stops (the segmented graphs stop after each router that misses and "
        "the host places the misses: q*'s fills and CPU branch), device (one graph a step, "
        "its layers filling their own misses: no CPU branch), shared (that graph, each layer "
        "sending the CPU worker B_H/(B_P+B_H) of its misses), or split (that graph, every "
        "fill cut between the link and the CPU worker; turns --split-expert on)",
    )
    parser.add_argument(
        "--pdl",
        nargs="+",
        default=None,
        metavar="WORD",
        help="measure each policy under each FREETOKEN_PDL value (on, exit, light, prefetch, "
        "off; kernels/triton/pdl.py), the decode graphs captured again for each; rows are "
        "then named policy@word (default: the environment's FREETOKEN_PDL, rows by policy)",
    )
    parser.add_argument(
        "--l2",
        nargs="+",
        choices=("off", "on"),
        default=None,
        help="measure each policy with EngineConfig.l2_prefetch off and/or on (rows policy+l2 "
        "when both; default: as loaded, off)",
    )
    parser.add_argument(
        "--popular-pins",
        type=float,
        default=POPULAR_PINS,
        metavar="FRACTION",
        help="EngineConfig.popular_pins for the device paths (gpu-fill, adaptive): this "
        "fraction of the slots pinned for each layer's most used experts (default: "
        "EngineConfig's, %(default)s; 0: LRU)",
    )
    parser.add_argument(
        "--fill-through",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="EngineConfig.fill_through: the device paths' MoE kernels store each moved expert "
        "into its slot as they read it from the pool, no copy kernel (default off)",
    )
    parser.add_argument(
        "--split-expert",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="EngineConfig.split_expert: adaptive's split path among its step paths (default "
        "off; --adaptive-path split turns it on)",
    )
    parser.add_argument(
        "--shared-gate",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="adaptive's shared path waits for the fill race to judge (default; "
        "--no-shared-gate runs a held shared path from the first step)",
    )
    parser.add_argument(
        "--hold-share",
        type=float,
        nargs="+",
        default=None,
        metavar="FRACTION",
        help="with --adaptive-path shared: one adaptive row per CPU share held (a fraction of "
        "each layer's misses), named adaptive~FRACTION, in place of q*'s share tuned by its "
        "trials: step time against the share",
    )
    args = parser.parse_args(argv)
    if args.hold_share is not None:
        if args.adaptive_path != "shared":
            parser.error("--hold-share holds the shared path's share: give --adaptive-path shared")
        if not all(0.0 <= x <= 1.0 for x in args.hold_share):
            parser.error(f"--hold-share takes fractions in [0, 1], got {args.hold_share}")
    held = max(args.batches) * (args.context + max(args.decode, WARM_UP) + 16)
    if args.context < 1 or held > KV_TOKENS:
        parser.error(f"--context {args.context}: {max(args.batches)} sequences of it and "
                     f"their decoded tokens need ~{held} KV tokens; the engine holds "
                     f"{KV_TOKENS}")  # fmt: skip
    dev = torch.device("cuda")
    b_hbm = hbm_copy_bandwidth(dev)
    b_sum = host_read_bandwidth()
    t0 = time.perf_counter()
    engine, b_p, b_h = offload_engine(args.layers, args.budget_gb, args.chunk)
    bank = engine.loaded.bank
    bank.fill_behind = args.fill_behind
    bank.fill_through = args.fill_through  # before the graphs are captured (each regime's)
    # before adaptive starts its CPU worker (_use_policy)
    bank.split_expert = args.split_expert or args.adaptive_path == "split"
    engine.config.popular_pins = args.popular_pins  # made when a device path runs (_use_policy)
    engine.overlap.enabled = args.overlap
    spec = engine.spec
    build_s = time.perf_counter() - t0
    expert_bytes = bank.pool.expert_bytes
    # The cap on the two miss paths together: the best of a plain read and both paths measured
    # at once (the CPU kernel out-reads a torch sum on this host), probed twice now and again
    # after each regime (host_caps.py); a probe that fails leaves the other caps, said.
    caps = HostCaps()
    caps.observe("before the engine", b_p, b_h, b_sum)

    def probe(when: str) -> dict:  # the caps now, and the record printed (its cores' use)
        both = caps.probe(when, bank.pool.w13, bank.pool.w2, dev)
        print("host probe", json.dumps(caps.probes[-1]), flush=True)
        return both

    both = probe("start")
    probe("start, again")
    dense_read = engine.loaded.dense_bytes - engine.loaded.model.embed_tokens.device_nbytes
    # A step reads every held token's K and V in every attention layer: ~0.1 MB a token at 48
    # layers, so ~6 MB at the default 64-token context beside ~5 GB of weights; ~0.8 GB at 8k.
    kv_per_token = kv_bytes_per_token(engine)
    rng = random.Random(0)
    report = {
        "bench": "offload",
        "device": torch.cuda.get_device_name(dev),
        "layers": spec.n_layers,
        "budget_gb": args.budget_gb,
        "fill_behind": args.fill_behind,
        "popular_pins": args.popular_pins,
        "context": args.context,
        "fill_through": args.fill_through,
        "split_expert": bank.split_expert,  # adaptive's split path offered (or held)
        "overlap": args.overlap,
        "adaptive_path": args.adaptive_path,  # None: measured (step_paths.py)
        "shared_gate": args.shared_gate,
        "hold_share": args.hold_share,  # None: q*'s share, tuned by ShareTrials
        "slots": bank.cache.n_slots,
        "pool_rows": bank.pool.n_rows,
        "cached_fraction": bank.cache.n_slots / bank.pool.n_rows,
        "pool_gb": bank.pool.nbytes / 1e9,
        "pool_pinned": bank.pool.pinned,
        "build_s": build_s,
        "hbm_copy_gb_s": b_hbm / 1e9,
        **caps_report(caps),
        "host_read_sum_gb_s": b_sum / 1e9,
        "host_paths_measured": both,
        "routing": "per decode key: native (the random router), uniform or zipf:S,loc:P replay",
        "rounds": args.rounds,
        "round_kept": "median tok/s; with an even count the lower middle round (2: the slower)",
        "decode": {},
        "prefill": {},
    }
    print(json.dumps({k: v for k, v in report.items() if not isinstance(v, dict)}), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"offload_{spec.n_layers}l_{int(args.budget_gb)}gb.json"

    def save() -> None:  # after every figure: a run cut short keeps what it measured
        path.write_text(json.dumps(report, indent=1))

    model = engine.loaded.model
    variants = held_shares(measured_variants(args.policies, args.pdl, args.l2), args.hold_share)
    for regime_name in () if args.skip_decode else args.regimes:
        if regime_name == "native":
            model.set_expert_bank(bank)
        else:
            regime = Regime.parse(regime_name)
            gen = TraceGenerator(spec.n_moe_layers, spec.n_experts, spec.top_k, regime, seed=0)
            model.set_expert_bank(TracedRouting(bank, gen))
        engine.capture_graphs()  # graphs call the bank object they were captured with
        for batch in args.batches:
            rounds: dict[str, list[dict]] = {name: [] for name, *_ in variants}
            for r in range(args.rounds):
                # Each round starts at another policy: the device host's speed changes over
                # seconds, so a policy always measured first (or last) would carry a bias.
                order = variants[r % len(variants) :] + variants[: r % len(variants)]
                for name, policy, word, l2, held in order:
                    with kernel_variant(engine, word, l2):
                        row = _measure(engine, bank, policy, batch, args.decode, rng, b_p, b_h,
                                       args.adaptive_path, args.shared_gate, args.context,
                                       held)  # fmt: skip
                    kv_read = batch * (args.context + args.decode / 2) * kv_per_token
                    add_limits(row, policy, batch, expert_bytes, dense_read + kv_read, caps,
                               b_hbm)  # fmt: skip
                    rounds[name].append(row)
                    print(f"{regime_name}|b{batch}|{name}|round{r}", json.dumps(row), flush=True)
            for name, rows in rounds.items():
                key = f"{regime_name}|b{batch}|{name}"
                report["decode"][key] = _median_round(rows)
                print(key, json.dumps(report["decode"][key]), flush=True)
            save()
        # The host's speed changes over seconds: probe again, and bound every row so far by
        # the best caps seen (host_caps.py).
        probe(f"after {regime_name}")
        for row in report["decode"].values():
            caps.bound(row, b_hbm)
        report.update(caps_report(caps))
        save()
    model.set_expert_bank(bank)
    _use_policy(engine, bank, "adaptive", recapture=True)
    bank.cache.reset()
    for double in () if args.skip_prefill else (True, False):
        if not double:
            bank.streamer = LayerStreamer(
                bank.pool, bank.cache, spec.n_experts, spec.n_moe_layers, dev, False
            )
        if double:  # warm-up: compile the kernels for every chunk shape before timing
            for n in args.prefill:
                timed_prefill(engine, n, rng)
        for n in args.prefill:
            key = f"{n}_{'double' if double else 'single'}"
            report["prefill"][key] = prefill_row(engine, n, args.chunk, caps.b_p, rng)
            print(key, json.dumps(report["prefill"][key]), flush=True)
            save()
    print("\n".join(closing_lines(report)))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
