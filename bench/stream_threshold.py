"""Where prefill chunks should start streaming whole layers: measured, beside the model.

    python -m freetoken_agent.bench stream-threshold [--layers 12] [--budget-gb 8.59]
        [--tokens 64 128 256 384 512 768 1024 1536] [--repeats 3] [--regime uniform] [--out DIR]

An offloaded engine prefills a chunk of fewer than `stream_min_tokens` tokens by placing its
misses expert by expert (fills beside CPU work, adaptive's split), and a longer one by
streaming every layer's experts behind compute. engine/experts/stream_threshold.py derives
the crossover from B_P, B_H, the CPU's knee and the slots' share of the experts; the engine
defaults to a measured 512 (EngineConfig.stream_min_tokens). This measures it: the peer
slice (bench offload's engine, policy adaptive), its cache filled by a short decode before
each prefill, then a fresh prompt of each length prefilled with every chunk streamed
(stream_min_tokens 1) and with every chunk placed (stream_min_tokens above the length).
Routing is replayed from `--regime` (routing_traces.py; default uniform, as the model
assumes) for prefill chunks too. Under the random router on random weights ("native") the
fourteenth session's run placed 64 tokens in 42 ms: less than the misses of ~127 experts a
layer could cost, so its prompts reach fewer experts than a trained router's would. Each row
records the distinct experts a layer its placed prefills touched, and how many were hits,
filled and run on the CPU. Medians of `--repeats` after one warm-up each. Reports both
times per length, each beside the model's figure from this run's B_P, B_H and host read
bandwidth and the CPU's knee, measured first (for streaming, its limit: the non-resident
experts' bytes over B_P, with the slots lent as staging counted as non-resident), and the
measured crossover beside the predicted one. JSON to
`<out>/stream_threshold_<layers>l.json`.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path

import torch

from freetoken_agent.bench.environment import ENVIRONMENT
from freetoken_agent.bench.limits import host_read_bandwidth
from freetoken_agent.bench.offload import offload_engine
from freetoken_agent.bench.offload_decode import decode_window, start_policy
from freetoken_agent.bench.offload_limits import timed_prefill
from freetoken_agent.bench.routing_traces import Regime, TracedRouting, TraceGenerator
from freetoken_agent.engine.config import EngineConfig
from freetoken_agent.engine.experts import calibration
from freetoken_agent.engine.experts.policy import Bandwidths
from freetoken_agent.engine.experts.stream_threshold import layer_seconds, stream_threshold
from freetoken_agent.engine.experts.streaming import ring_slots
from freetoken_agent.help_format import DefaultsHelpFormatter

RESULTS = Path(__file__).resolve().parent / "results"
WARM_DECODE = 24  # tokens decoded before each prefill: the cache full, as mid-session


def _prefill_seconds(engine, bank, tokens: int, stream: bool, rng, placed: dict) -> float:
    """One prefill of a fresh `tokens`-token prompt, every chunk streamed or placed; a placed
    one adds its cache counters (per layer) to `placed`."""
    decode_window(engine, WARM_DECODE, rng)
    reserve = getattr(engine.loaded.model.expert_bank, "reserve", None)  # traced routing
    if reserve is not None:  # the prompt's draws before the clock starts
        reserve(tokens)
    saved = bank.stream_min_tokens
    bank.stream_min_tokens = 1 if stream else tokens + 1
    st, layers = bank.stats, engine.spec.n_moe_layers
    before = (st.experts, st.hits, st.fetched, st.on_cpu)
    try:
        seconds = tokens / timed_prefill(engine, tokens, rng)
    finally:
        bank.stream_min_tokens = saved
    if not stream:
        after = (st.experts, st.hits, st.fetched, st.on_cpu)
        for key, b, a in zip(("experts", "hits", "fetched", "on_cpu"), before, after, strict=True):
            placed.setdefault(key, []).append((a - b) / layers)
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="freetoken bench stream-threshold",
        description=__doc__,
        epilog=ENVIRONMENT,
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument("--layers", type=int, default=12, help="model depth (12: peer slice)")
    parser.add_argument("--budget-gb", type=float, default=8.59, help="GPU budget (GB)")
    parser.add_argument(
        "--tokens", type=int, nargs="+", default=[64, 128, 256, 384, 512, 768, 1024, 1536],
        help="prompt lengths (one chunk each)",
    )  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3, help="timed prefills per point")
    parser.add_argument(
        "--regime", default="uniform",
        help="routing of every call: uniform, zipf:S,loc:P, or native (the random router)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=RESULTS, help="JSON results folder")
    args = parser.parse_args(argv)
    engine, b_p, b_h = offload_engine(args.layers, args.budget_gb, chunk=max(args.tokens))
    bank, spec = engine.loaded.bank, engine.spec
    host = host_read_bandwidth()
    start_policy(engine, bank, "adaptive", b_p, b_h)
    # The CPU's knee as `freetoken calibrate` measures it: adaptive's split of a chunk's misses
    # and the model read it (the default is 8; the H200 host measured 4.7-5.4).
    knee = calibration.measure_knee(spec.hidden_size, spec.moe_intermediate_size, torch.bfloat16)
    bank.bandwidths.knee = knee
    if args.regime != "native":
        gen = TraceGenerator(spec.n_moe_layers, spec.n_experts, spec.top_k,
                             Regime.parse(args.regime), seed=0)  # fmt: skip
        engine.loaded.model.set_expert_bank(TracedRouting(bank, gen))
        engine.capture_graphs()  # graphs call the bank object they were captured with
    rows_total = spec.n_moe_layers * spec.n_experts
    resident = min(1.0, bank.cache.n_slots / rows_total)
    expert = bank.pool.expert_bytes
    bw = Bandwidths(b_p, b_h, knee)
    streamer = bank.streamer  # lent staging slots evict experts while a chunk streams
    staging = ring_slots(spec.n_experts, streamer.n_buffers) / rows_total if streamer.lend else 0.0
    predicted = stream_threshold(spec.n_experts, spec.top_k, expert, bw, resident, host, staging)
    rng = random.Random(0)
    rows = []
    for tokens in args.tokens:
        row = {"tokens": tokens}
        for mode in ("stream", "place"):
            placed: dict[str, list[float]] = {}
            times = [
                _prefill_seconds(engine, bank, tokens, mode == "stream", rng, placed)
                for _ in range(args.repeats + 1)
            ][1:]  # the first compiles what this length needs
            row[f"{mode}_ms"] = 1e3 * statistics.median(times)
            row[f"{mode}_ms_all"] = [round(1e3 * t, 2) for t in times]
        # distinct experts a layer the placed prefills touched, and where they ran (means)
        row["placed_per_layer"] = {k: round(statistics.mean(v), 1) for k, v in placed.items()}
        # The model's figures for every layer: streaming's is its floor (the non-resident
        # experts over the link), placing's the split of those misses between link and CPU.
        streamed, placed = layer_seconds(tokens, spec.n_experts, spec.top_k, expert, bw,
                                         resident, host, staging)  # fmt: skip
        row["stream_limit_ms"] = 1e3 * spec.n_moe_layers * streamed
        row["place_model_ms"] = 1e3 * spec.n_moe_layers * placed
        rows.append(row)
        print(
            f"{tokens:6d} tokens: streamed {row['stream_ms']:8.1f} ms (limit "
            f"{row['stream_limit_ms']:.1f}), placed {row['place_ms']:8.1f} ms (model "
            f"{row['place_model_ms']:.1f}); placed per layer {row['placed_per_layer']}",
            flush=True,
        )
    measured = next((r["tokens"] for r in rows if r["stream_ms"] <= r["place_ms"]), None)
    report = {
        "bench": "stream-threshold",
        "device": torch.cuda.get_device_name(),
        "layers": args.layers,
        "budget_gb": args.budget_gb,
        "regime": args.regime,
        "slots": bank.cache.n_slots,
        "resident_fraction": resident,
        "b_p_gb_s": b_p / 1e9,
        "b_h_gb_s": b_h / 1e9,
        "host_read_gb_s": host / 1e9,
        "cpu_knee_tokens": knee,
        "staging_fraction": staging,
        "predicted_threshold": predicted,
        "measured_threshold": measured,  # the first length that streamed no slower (or None)
        "default_threshold": EngineConfig().stream_min_tokens,
        "rows": rows,
    }
    print(f"crossover: measured {measured}, predicted {predicted} tokens")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"stream_threshold_{args.layers}l.json"
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
