"""`bench offload`'s decode measurement: a policy set up from an empty cache, its untimed
warm-up and timed window, and the row it reports.

A row is one policy at one batch and routing regime (routing_traces.py), decoded from an empty
cache after the same WARM_UP untimed steps (the cache fills; adaptive measures its step paths
and split modes), then timed: tok/s with miss rate and bytes over PCIe per token (adaptive: its
step path and split mode). The window counts what it produced (tokens, forward passes), not
`engine.step()` calls, and its counters are per decoded token (a step of batch 4 makes 4). A
run measures each row in `--rounds` rounds and keeps the median (with an even count the lower
middle round: `median_round`). The step times and CPU-share figures a row carries are
offload_summaries.py's; its limits are offload_limits.py's.
"""

from __future__ import annotations

import time

import torch

from freetoken_agent.bench import cpu_load
from freetoken_agent.bench.offload_summaries import (
    cpu_seen_summary,
    cpu_share_stats,
    step_times_summary,
    trial_positions,
)
from freetoken_agent.engine.experts import step_paths
from freetoken_agent.engine.experts.cpu_share import job_summary
from freetoken_agent.engine.experts.offload import decode_graph_kind
from freetoken_agent.engine.experts.policy import DEVICE_PATH_POLICIES
from freetoken_agent.engine.experts.split_trials import BLOCK, MODES, ROTATIONS
from freetoken_agent.engine.sampling_params import SamplingParams

# Decode steps before the timed ones: the cache fills, and adaptive measures its step paths
# (step_paths.py) and its split modes once (every mode for BLOCK steps, ROTATIONS times:
# split_trials.py; on the stops path's steps only). The next measurement comes PERIOD steps
# after the first choice (~50 steps in), twice that when the first choice won clearly: then
# outside the peer slice's 256 timed tokens, as outside a user's first reply (a measurement
# inside them cost the uniform peer row 13%, thirty-fourth session).
PATH_STEPS = len(step_paths.PATHS) * step_paths.BLOCK * step_paths.ROTATIONS
WARM_UP = 8 + len(MODES) * BLOCK * ROTATIONS + PATH_STEPS + step_paths.WARM


def sync_device() -> None:
    """Wait for the device's queued work, so a clock read after it counts that work (a
    no-op without CUDA: the CPU engines of the tests)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def use_policy(engine, bank, policy: str, recapture: bool = False) -> None:
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
    use_policy(engine, bank, policy)
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


def decode_window(engine, n: int, rng, batch: int = 1, context: int = 64) -> tuple[float, dict]:
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
    filled0, read0 = bank.cache.bytes_filled, bank.stats.direct
    graphs = engine.runner.graphs
    # Direct graphs never re-run a segment: misses are read in place, so they keep no counter.
    reruns0 = getattr(graphs, "reruns", 0)
    # Segmented graphs: layers that stopped the step for the host, and the host's seconds
    # waiting on segments (the device-bound share of the step).
    stops0, wait0 = getattr(graphs, "missed_layers", 0), getattr(graphs, "wait_s", 0.0)
    releases0 = bank.cache.on_device.releases  # gpu-fill: the cache handed back to the host
    share = getattr(bank, "cpu_share", None)
    sync_device()
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
    sync_device()
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
    reads = st.direct - read0  # misses read over the link in place
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
        # Fills, and misses the kernels read over the link in place (direct; gpu-fill and the
        # device path where a layer found no slot to fill): both cross it once.
        "host_reads_per_token": reads * per_token,
        "pcie_bytes_per_token": (bank.cache.bytes_filled - filled0 + reads * bank.pool.expert_bytes)
        * per_token,
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


def _worker_window(before: dict[str, int], after: dict[str, int]) -> dict:
    """The CPU worker's jobs over the timed steps (cpu_share.py's counters)."""
    return job_summary({name: after[name] - before[name] for name in after})


def measure_policy(engine, bank, policy: str, batch: int, n: int, rng, b_p: float,
                   b_h: float, path: str | None = None, shared_gate: bool = True,
                   context: int = 64, held_share: float | None = None) -> dict:  # fmt: skip
    """One policy from an empty cache: WARM_UP decode steps (the cache fills; adaptive's
    first split trials run), then `n` timed. The row: tok/s, counters, online bandwidths."""
    start_policy(engine, bank, policy, b_p, b_h, path, shared_gate, held_share)
    decode_window(engine, WARM_UP, rng, batch, context)
    rate, st = decode_window(engine, n, rng, batch, context)
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


def median_round(rows: list[dict]) -> dict:
    """The round with the median tok/s (its counters with it), and every round's tok/s. With
    an even count, the lower of the two middle rounds: of 2 rounds, the slower."""
    ranked = sorted(rows, key=lambda row: row["tok_s"])
    return {**ranked[(len(ranked) - 1) // 2], "tok_s_rounds": [row["tok_s"] for row in rows]}
