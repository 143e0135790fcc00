"""Expert offloading on the device: decode per policy and streamed prefill, beside the limits.

    python -m freetoken_agent.bench offload [--layers 48] [--budget-gb 32] [--decode 48]

Builds a Qwen3-30B-A3B-shaped model (random bf16 weights; experts in a pinned host pool) under
a GPU budget, then: decode at batch 1 and 4 for each policy (cpu, transfer, adaptive, static,
direct, gpu-fill) and routing regime (routing_traces.py), each from an empty cache after the
same warm-up, with miss rate and bytes over PCIe per token (adaptive: its step path and split
mode), in `--rounds` rounds (the median reported; with an even count the lower middle
round); and
prefill of 4k/8k/16k-token prompts streamed in 8k chunks with two staging buffers and with one,
from an empty cache, then with two from a cache whose every slot holds an expert (`_warm`).
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
import functools
import json
import math
import random
import time
from pathlib import Path

import torch

from freetoken_agent.bench.decode_baseline import kv_bytes_per_token
from freetoken_agent.bench.environment import ENVIRONMENT
from freetoken_agent.bench.every_miss_switch import every_miss, every_miss_rows
from freetoken_agent.bench.host_caps import HostCaps
from freetoken_agent.bench.kernel_variants import kernel_variant, measured_variants
from freetoken_agent.bench.lend_switch import lend_rows, workspace_lending
from freetoken_agent.bench.limits import hbm_copy_bandwidth, host_read_bandwidth
from freetoken_agent.bench.offload_decode import (
    WARM_UP,
    held_shares,
    measure_policy,
    median_round,
    use_policy,
)
from freetoken_agent.bench.offload_limits import (
    add_limits,
    caps_report,
    closing_lines,
    fill_every_slot,
    prefill_limit,
    prefill_row,
    timed_prefill,
)
from freetoken_agent.bench.random_model import QWEN3_30B_A3B, peer_slice, random_engine
from freetoken_agent.bench.routing_traces import Regime, TracedRouting, TraceGenerator
from freetoken_agent.engine.config import POPULAR_PINS
from freetoken_agent.engine.experts import calibration, step_paths
from freetoken_agent.engine.experts.streaming import LayerStreamer
from freetoken_agent.engine.memory_cadence import FULL_EVERY
from freetoken_agent.help_format import DefaultsHelpFormatter
from freetoken_agent.kernels.expert_fills import COPY_PROGRAMS_MAX

RESULTS = Path(__file__).resolve().parent / "results"
POLICIES = ("cpu", "transfer", "adaptive", "static", "direct", "gpu-fill")
KV_TOKENS = 32768  # the engine's KV pool and max_model_len
STREAM_PROBE_EXPERTS = 16  # experts a timed copy of the prefill's B_P moves (~150 MB at 30B)


def offload_engine(layers: int, budget_gb: float, chunk: int, lend_workspace: bool = True):
    """(engine, B_P, B_H): the Qwen3-30B-A3B shape cut to `layers`, random weights, experts in
    a pinned host pool under a `budget_gb` GPU budget; both bandwidths measured first.
    `lend_workspace`: EngineConfig's (the workspace a decode step cannot need held as slots)."""
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
        lend_workspace=lend_workspace,
    )
    return engine, b_p, b_h


def _refill(engine, rng, held: list[int]) -> None:
    """A warm prefill row's cache state: the prefix cache dropped (the runs' random prompts,
    whose recently used pages would take slots from one run to the next), an idle engine's
    split (its safe points polled until any move due has come: a decision waits up to
    FULL_EVERY of them after the policy's min_gap, and the workspace lent to slots depends
    on the prompt before), emptied, then every slot given a random expert
    (`fill_every_slot`); the count resident appended to `held`. Every run of the row starts
    from the same slots."""
    engine.radix.reset()
    memory = engine.memory
    for _ in range(FULL_EVERY + memory.policy.min_gap if memory is not None else 0):
        engine.poll_memory()
    bank = engine.loaded.bank
    bank.cache.reset()
    held.append(fill_every_slot(bank, rng))


PEER_LAYERS, PEER_BUDGET_GB = 12, 8 * 2**30 / 1e9  # the peer slice: 8 GiB


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="freetoken bench offload",
        description=__doc__,
        epilog=ENVIRONMENT,
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument("--layers", type=int, default=48,
                        help="model depth (12: the peer slice, whose budget is 8 GiB)")  # fmt: skip
    parser.add_argument("--budget-gb", type=float, default=None,
                        help="GPU budget in GB (1e9 bytes); default 32, or 8.59 (8 GiB) with "
                        "--layers 12: the issue's peer slice, which at 32 would hold every "
                        "expert")  # fmt: skip
    parser.add_argument(
        "--decode", type=int, default=48,
        help="tokens each sequence of a row decodes, the first before the clock starts (its "
        f"prefill's), after WARM_UP ({WARM_UP}) untimed ones",
    )  # fmt: skip
    parser.add_argument(
        "--context", type=int, default=64, metavar="TOKENS",
        help="prompt tokens of each decoded sequence (agent histories run to 4k-32k; the "
        "limit counts their KV reads)",
    )  # fmt: skip
    parser.add_argument(
        "--prefill", type=int, nargs="+", default=[4096, 8192, 16384], metavar="TOKENS",
        help="prompt lengths prefilled, double buffer on and off",
    )  # fmt: skip
    parser.add_argument(
        "--chunk", type=int, default=8192, metavar="TOKENS",
        help="prefill chunk, the engine's max_batched_tokens: a prompt streams the pool once "
        "per chunk",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=RESULTS,
                        help="JSON results folder")  # fmt: skip
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
        "P = 0; traces seeded 0; the default's zipf:1.0,loc:0.7 is skew 1.0, locality 0.7)",
    )
    parser.add_argument(
        "--batches", type=int, nargs="+", default=[1, 4],
        help="decode batches (sequences decoded together)",
    )  # fmt: skip
    parser.add_argument(
        "--policies", nargs="+", choices=POLICIES, default=list(POLICIES),
        help="decode policies",
    )  # fmt: skip
    parser.add_argument(
        "--prefill-repeats", type=int, default=3,
        help="prompts per prefill row, each from the row's cache state; the median is "
        "reported (with an even count the slower middle one), every run's tok/s beside it",
    )  # fmt: skip
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="decode measurements per policy, each round starting at another policy; the "
        "median round is reported (the device host's speed changes over seconds), with an "
        "even count the lower of the two middle ones: at 2 rounds the slower round",
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
        "read (EngineConfig.overlap_schedule; --no-overlap for the plain loop)",
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
        "fraction of the slots pinned for each layer's most used experts (0: LRU; the "
        "default is EngineConfig's)",
    )
    parser.add_argument(
        "--fill-through",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="EngineConfig.fill_through: the device paths' MoE kernels store each moved expert "
        "into its slot as they read it from the pool, no copy kernel (default off)",
    )
    parser.add_argument(
        "--lend-workspace",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="EngineConfig.lend_workspace: while only decodes run, the part of a full "
        "step's workspace they cannot need holds expert slots, evicted when a prompt comes "
        "(the warm prefill rows then start with fewer residents than the decode left: both "
        "counts are reported)",
    )
    parser.add_argument(
        "--lend-ab",
        action="store_true",
        help="measure every decode row twice in each round, in one engine: the workspace lent "
        "to slots (rows NAME+lent) and kept whole (NAME+whole), switched at run time "
        "(bench/lend_switch.py: two processes differ by the host's drift more)",
    )
    parser.add_argument(
        "--every-miss-ab",
        action="store_true",
        help="measure every adaptive decode row twice in each round, in one engine: its shared "
        "path's CPU share free to take a layer's every miss where fills do not pay (rows "
        "NAME+every, the default) and held to all but one (NAME+kept) "
        "(bench/every_miss_switch.py)",
    )
    parser.add_argument(
        "--split-expert",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="EngineConfig.split_expert: adaptive's split path among its step paths (default "
        "off; --adaptive-path split turns it on)",
    )
    parser.add_argument(
        "--copy-programs",
        type=int,
        default=None,
        metavar="N",
        help="the device paths' fill copy kernel grid (EngineConfig.copy_programs; default: "
        "each grid of COPY_PROGRAM_CHOICES timed at the start, the fastest kept, as `freetoken "
        "calibrate` does)",
    )
    parser.add_argument(
        "--shared-gate",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="adaptive's shared path waits for the fill race to judge (--no-shared-gate runs a "
        "held shared path from the first step)",
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
    if args.budget_gb is None:
        args.budget_gb = PEER_BUDGET_GB if args.layers == PEER_LAYERS else 32.0
    elif not (math.isfinite(args.budget_gb) and args.budget_gb > 0):
        parser.error(f"--budget-gb must be a finite number > 0, got {args.budget_gb}")
    if args.hold_share is not None:
        if args.adaptive_path != "shared":
            parser.error("--hold-share holds the shared path's share: give --adaptive-path shared")
        if not all(0.0 <= x <= 1.0 for x in args.hold_share):
            parser.error(f"--hold-share takes fractions in [0, 1], got {args.hold_share}")
    if args.prefill_repeats < 1:
        parser.error(f"--prefill-repeats must be >= 1, got {args.prefill_repeats}")
    if args.copy_programs is not None and not 1 <= args.copy_programs <= COPY_PROGRAMS_MAX:
        parser.error(f"--copy-programs takes 1 to {COPY_PROGRAMS_MAX}, got {args.copy_programs}")
    held = max(args.batches) * (args.context + max(args.decode, WARM_UP) + 16)
    if args.context < 1 or held > KV_TOKENS:
        parser.error(f"--context {args.context}: {max(args.batches)} sequences of it and "
                     f"their decoded tokens need ~{held} KV tokens; the engine holds "
                     f"{KV_TOKENS}")  # fmt: skip
    dev = torch.device("cuda")
    b_hbm = hbm_copy_bandwidth(dev)
    b_sum = host_read_bandwidth()
    t0 = time.perf_counter()
    engine, b_p, b_h = offload_engine(args.layers, args.budget_gb, args.chunk,
                                      args.lend_workspace)  # fmt: skip
    bank = engine.loaded.bank
    bank.fill_behind = args.fill_behind
    bank.fill_through = args.fill_through  # before the graphs are captured (each regime's)
    h, i = engine.spec.hidden_size, engine.spec.moe_intermediate_size
    copy_rates = calibration.copy_grid_rates(h, i, torch.bfloat16)  # reported beside B_P
    bank.copy_programs = args.copy_programs or calibration.fastest_grid(copy_rates)
    print(f"fill copies on {bank.copy_programs} programs; grids timed (GB/s, B_P "
          f"{b_p / 1e9:.1f}):", {p: round(r / 1e9, 1) for p, r in copy_rates.items()},
          flush=True)  # fmt: skip
    # before adaptive starts its CPU worker (use_policy)
    bank.split_expert = args.split_expert or args.adaptive_path == "split"
    engine.config.popular_pins = args.popular_pins  # made when a device path runs (use_policy)
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
        "copy_programs": bank.copy_programs,
        "copy_grid_gb_s": {p: r / 1e9 for p, r in copy_rates.items()},  # each timed grid
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
    variants = every_miss_rows(lend_rows(variants, args.lend_ab), args.every_miss_ab)
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
                for name, policy, word, l2, held, lend, every in order:
                    with (kernel_variant(engine, word, l2), workspace_lending(engine, lend),
                          every_miss(engine, every)):  # fmt: skip
                        row = measure_policy(engine, bank, policy, batch, args.decode, rng,
                                             b_p, b_h, args.adaptive_path, args.shared_gate,
                                             args.context, held)  # fmt: skip
                    kv_read = batch * (args.context + args.decode / 2) * kv_per_token
                    add_limits(row, policy, batch, expert_bytes, dense_read + kv_read, caps,
                               b_hbm)  # fmt: skip
                    rounds[name].append(row)
                    print(f"{regime_name}|b{batch}|{name}|round{r}", json.dumps(row), flush=True)
            for name, rows in rounds.items():
                key = f"{regime_name}|b{batch}|{name}"
                report["decode"][key] = median_round(rows)
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
    use_policy(engine, bank, "adaptive", recapture=True)
    bank.cache.reset()
    # The streamer copies a layer's absent experts in runs of up to a ring buffer's group
    # (streaming.STREAM_GROUP), which the link moves faster than one expert's copies (DESIGN:
    # 55.3 against 54.1 GB/s): the prefill limit takes the faster rate, or its rows would read
    # ~2% high.
    b_p_stream = (
        0.0
        if args.skip_prefill
        else max(caps.b_p, calibration.measure_pcie(STREAM_PROBE_EXPERTS * expert_bytes, n=4))
    )
    report["b_p_stream_gb_s"] = b_p_stream / 1e9
    for double in () if args.skip_prefill else (True, False):
        if not double:
            bank.streamer = LayerStreamer(
                bank.pool, bank.cache, spec.n_experts, spec.n_moe_layers, dev, False
            )
        if double:  # warm-up: compile the kernels for every chunk shape before timing, from
            # an emptied cache and a full one (whose parts sum: kernels of their own)
            for n in args.prefill:
                timed_prefill(engine, n, rng)
                fill_every_slot(bank, rng)
                timed_prefill(engine, n, rng)
                bank.cache.reset()
        for n in args.prefill:
            key = f"{n}_{'double' if double else 'single'}"
            repeats = args.prefill_repeats
            report["prefill"][key] = prefill_row(engine, n, args.chunk, b_p_stream, rng, repeats,
                                                 bank.cache.reset)  # fmt: skip
            print(key, json.dumps(report["prefill"][key]), flush=True)
            save()
        for n in args.prefill if double else ():  # the cache full, as decoding leaves it
            held: list[int] = []  # experts resident before each run (every slot's)
            fill = functools.partial(_refill, engine, rng, held)
            row = prefill_row(engine, n, args.chunk, b_p_stream, rng, args.prefill_repeats, fill)
            resident = held[-1]
            assert len(set(held)) == 1, held  # every run from as many resident experts
            # Beside the limit of what crossed the link, issue 3's own: the bytes not
            # resident before it (the streamer's ring, lent from the slots, evicts a few).
            before = (bank.pool.n_rows - resident) * bank.pool.expert_bytes
            strict = prefill_limit(n, args.chunk, b_p_stream, before)
            row.update(resident_before=resident, limit_not_resident_tok_s=strict,
                       of_limit_not_resident=row["tok_s"] / strict)  # fmt: skip
            if n <= args.chunk:  # one chunk: the streamer's last plan was its start
                # With the workspace lent to slots (--lend-workspace) the prompt's workspace
                # evicted some of them before its chunk began.
                at_start = bank.streamer.resident_at_plan
                absent = (bank.pool.n_rows - at_start) * bank.pool.expert_bytes
                limit = prefill_limit(n, args.chunk, b_p_stream, absent)
                row.update(resident_at_start=at_start, limit_at_start_tok_s=limit,
                           of_limit_at_start=row["tok_s"] / limit)  # fmt: skip
            report["prefill"][f"{n}_double_warm"] = row
            print(f"{n}_double_warm", json.dumps(report["prefill"][f"{n}_double_warm"]))
            save()
            bank.cache.reset()
    print("\n".join(closing_lines(report)))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
