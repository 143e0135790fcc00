"""Elastic memory over a growing agent session, against two fixed splits (issue 6's acceptance).

    python -m freetoken_agent.bench elastic [--shape S] [--layers N] [--budget-gb 32]
    python -m freetoken_agent.bench elastic --cpu-smoke      # CI: tiny model, 4 short turns

--shape qwen3-30b-a3b (default, 48 attention layers) or qwen3.6-35b-a3b (40 layers, every 4th
full attention, the rest gated DeltaNet: a quarter of the KV per token), random bf16 weights,
experts in a pinned host pool, policy adaptive, context raised to hold the session, under
--budget-gb. --turns turns, context growing geometrically from --start-tokens to --end-tokens:
each re-sends the history (earlier prompts and the engine's own answers: prefix reuse serves
them; a hybrid model resumes from the checkpoint at the previous prompt's end, an anchor) plus
new random tokens (fixed seed), then decodes --decode-tokens. Three engines, each built fresh
from the same seed, run the same session: elastic (default config: KV pages and expert slots
share one arena, split on demand), fixed-first (elastic=False, kv_tokens = turn 1's context +
decode, the rest to slots) and fixed-last (kv_tokens = the last turn's context + decode). A
turn a split cannot hold (prompt refused, fewer tokens decoded than asked, an error) is reported
failed and the session goes on with a scripted answer in the engine's place; an engine that
cannot be built fails every turn.

Pressure: another process (bench/vram_hog.py, its own CUDA context: it gets only what the
driver has free). After each engine is built and warmed up (a prompt of one prefill chunk: its
allocator then holds its working memory), the other program takes ballast until the device has
the engine's `memory_reserve` + --headroom-gb free (+ what the elastic arena may still map up to
its budget). Before turn --pressure-turn it starts taking --pressure-gb in 256 MiB pieces,
retrying a refused piece every 20 ms for up to --pressure-timeout-s; the turn runs meanwhile,
then the bench polls the idle engine (`poll_memory`) every 50 ms until the other program
answers. The elastic engine follows free memory: as it drops below the reserve, the safe points
lower the budget and unmap the arena's unused chunks, and the other program gets them. A fixed
split gives nothing back: the other program gets what was free (if the engine then needs more
memory of its own, its turn fails, recorded as such). Before turn pressure_turn +
--pressure-turns it releases what it took; the bench polls until the elastic budget is back
(within one piece) or the timeout. Recorded: per engine what was asked and got, in how long,
the budget before, under and after; per turn the budget, the arena's mapped bytes and the free
device memory. --cpu-smoke runs the same flow on bench/simulated_device.py (the other program
a counter stepped between engine steps and polls; the elastic engine watches its free memory):
the take is a quarter of the arena, the reserve an eighth, the headroom a sixteenth.
--routing replays a synthetic regime for decode (bench/routing_traces.py; prefill keeps the
router's ids).

Per turn and engine: decode tok/s beside its limit (dense, hit-expert and KV bytes at B_HBM,
miss bytes at B_P + B_H, measured in this run), TTFT beside its limit (prefilled tokens at chunk /
(pool bytes / B_P) tok/s), reuse, slots, KV pages, decode miss rate, preemptions, failure.
Summary: elastic >= both fixed splits on every turn (within --noise; a failed fixed turn is
slower), elastic never failed, its last-turn decode within 12% of its first. The JSON (--out) is
rewritten after every turn, with the elastic memory trace; a PNG goes beside it (without
matplotlib a notice: `python -m freetoken_agent.bench.memory_plot OUT.json OUT.png --x step`).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from freetoken_agent.bench.compile_log import CompileLog
from freetoken_agent.bench.elastic_pressure import Pressure, memory_row
from freetoken_agent.bench.elastic_report import ENGINES, merge, plot, summarize
from freetoken_agent.bench.elastic_rows import HEAD, Limits, print_row
from freetoken_agent.bench.elastic_turn import host_profile, run_turn, warm_up
from freetoken_agent.bench.knobs import add_knobs, resolve_knobs
from freetoken_agent.bench.random_model import QWEN3_30B_A3B, peer_slice, random_engine
from freetoken_agent.bench.routing_traces import Regime, TracedRouting, TraceGenerator
from freetoken_agent.bench.turn_watch import TurnWatch
from freetoken_agent.engine.engine import Engine
from freetoken_agent.engine.experts.placement import workspace_bytes
from freetoken_agent.engine.kv.pool import KVPool
from freetoken_agent.engine.kv.recurrence import recurrent_device_bytes
from freetoken_agent.engine.loading import dense_nbytes

RESULTS = Path(__file__).resolve().parent / "results"
# The same family at toy size for --cpu-smoke (fp32): 4 MoE layers x 16 experts = 64 pool rows.
TINY_QWEN3_MOE = {
    **QWEN3_30B_A3B,
    **dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4),
    **dict(num_key_value_heads=2, head_dim=16, intermediate_size=96, moe_intermediate_size=32),
    **dict(num_experts=16, num_experts_per_tok=2, torch_dtype="float32", eos_token_id=2),
    "max_position_embeddings": 4096,
}
SMOKE_SLOTS = 40  # slots the simulated budget holds beside the first turn's KV

# (option, device default, --cpu-smoke default, help)
KNOBS = (
    ("--turns", 20, 4, "turns in the session"),
    ("--start-tokens", 2048, 96, "context of turn 1 (tokens)"),
    ("--end-tokens", 100_000, 480, "context of the last turn (tokens); geometric growth between"),
    ("--decode-tokens", 64, 8, "tokens decoded per turn"),
    ("--pressure-turn", 10, 3, "turn (1-based) before which the other program takes memory"),
    ("--pressure-turns", 3, 1, "turns it holds the memory before it releases it"),
    ("--chunk", 8192, 128, "max_batched_tokens: tokens per step (the prefill chunk)"),
)


def session(args) -> list[tuple[int, list[int], list[int]]]:
    """(context, new tokens, scripted answer) per turn: turn t's prompt is the history (every
    earlier prompt and answer) plus its new tokens, `context` tokens in all."""
    rng = random.Random(args.seed)
    ratio = (args.end_tokens / args.start_tokens) ** (1 / max(1, args.turns - 1))
    turns, history = [], 0
    for t in range(args.turns):
        context = max(round(args.start_tokens * ratio**t), history + 1)
        new = [rng.randrange(3, args.vocab) for _ in range(context - history)]
        answer = [rng.randrange(3, args.vocab) for _ in range(args.decode_tokens)]
        turns.append((context, new, answer))
        history = context + args.decode_tokens
    return turns


def shape_config(args) -> tuple[dict, int]:
    """(model config, stream_min_tokens) of --shape at --layers (device) or toy size."""
    from freetoken_agent.bench import agent  # the Qwen3.6 shape lives with its first bench

    if args.shape == "qwen3.6-35b-a3b":
        # 128 tokens of a 256-expert top-8 layer touch ~98% of its experts: stream from there.
        cfg = agent.TINY_HYBRID if args.cpu_smoke else agent.device_config(args.layers or 40)
        return dict(cfg), 128
    cfg = TINY_QWEN3_MOE if args.cpu_smoke else peer_slice(QWEN3_30B_A3B, args.layers or 48)
    return dict(cfg), 512


def build(args, name: str, turns) -> Engine:
    first, last = turns[0][0], turns[-1][0]
    common = dict(max_model_len=last + args.decode_tokens + 16, max_batched_tokens=args.chunk)
    options = dict(common, max_num_seqs=4, gpu_budget=args.budget)
    if name != "elastic":
        ctx = first if name == "fixed-first" else last
        options.update(elastic=False, kv_tokens=ctx + args.decode_tokens)
    elif args.cpu_smoke:  # the default 64k-token arena start does not fit a toy budget
        options.update(kv_tokens=first + args.decode_tokens)
        # Moves of the split and of the budget in the toy arena's scale (64 MiB is a GPU's).
        options.update(elastic_group_bytes=args.smoke_group)
    if args.cpu_smoke:
        options.update(device="cpu", std=0.1, policy="transfer")
    else:
        options.update(policy=args.policy, stream_min_tokens=args.stream_min)
    engine = random_engine(args.cfg, pool=args.pool, **options)
    # One host pool for every engine of the run: drawn and pinned once (a minute at 58 GB).
    args.pool = getattr(engine.loaded.bank, "pool", None) or args.pool
    return engine


def smoke_budget(cfg: dict, args) -> tuple[int, int]:
    """A simulated budget on the CPU: dense weights, workspace, staging buffers, turn 1's KV
    and SMOKE_SLOTS slots (as tests/engine/test_elastic_memory.py builds one); and the arena
    (the KV and the slots)."""
    probe = random_engine(cfg, device="cpu", policy="resident", max_batched_tokens=args.chunk)
    spec, config = probe.spec, probe.config
    s = config.page_size
    page = KVPool.page_bytes(
        len(spec.attention_layers), s, spec.n_kv_heads, spec.head_dim, spec.dtype
    )
    pages = -(-(args.start_tokens + args.decode_tokens) // s) + 1
    staging = 2 * spec.n_experts * spec.expert_bytes
    arena = pages * page + (SMOKE_SLOTS + 1) * spec.expert_bytes
    recurrent = recurrent_device_bytes(spec, config, torch.device("cpu"), spec.dtype, 0)
    fixed = dense_nbytes(probe.loaded.model) + workspace_bytes(spec, config) + staging + recurrent
    return fixed + arena, arena


def install_routing(engine: Engine, args) -> None:
    """--routing: a synthetic regime for decode (routing_traces.py), as bench/offload.py does."""
    if args.routing == "native":
        return
    spec, bank = engine.spec, engine.loaded.bank
    regime = Regime.parse(args.routing)
    gen = TraceGenerator(spec.n_moe_layers, spec.n_experts, spec.top_k, regime, args.seed)
    traced = TracedRouting(bank, gen, max_tokens=engine.config.max_num_seqs)
    engine.loaded.model.set_expert_bank(traced)
    if engine.runner.graphs is not None:
        engine.capture_graphs()  # graphs call the bank object they were captured with


def run_engine(args, name: str, turns, limits: Limits, entry: dict, save) -> Engine | None:
    """The session on one engine into entry["turns"] (saved after each turn), another program
    beside it (entry["pressure"])."""
    t0 = time.perf_counter()
    try:
        engine = build(args, name, turns)
        install_routing(engine, args)
    except Exception as e:  # noqa: BLE001 - a split that cannot be built fails every turn
        entry["build_error"] = f"{type(e).__name__}: {e}"
        engine = None
    entry["build_s"] = time.perf_counter() - t0
    pressure = None
    if engine is not None:
        entry["warmup"] = warm_up(engine, args)
        entry["warmup"]["compiles"] = args.compiles.take()
        entry["pressure"] = {}
        try:
            pressure = Pressure(args, engine, entry["pressure"])
        except Exception as e:  # noqa: BLE001 - recorded: the session runs without pressure
            entry["pressure"]["error"] = f"{type(e).__name__}: {e}"
    history: list[int] = []
    try:
        for t, (_, new, answer) in enumerate(turns, start=1):
            ids = history + new
            row = {"turn": t, "context": len(ids), "pressure": False}
            if engine is None:
                row["failed"] = f"not built: {entry['build_error']}"
            else:
                if pressure is not None:
                    pressure.before_turn(t)
                    row["pressure"] = pressure.active
                tick = pressure.tick if pressure is not None else None
                watch = TurnWatch(engine, args.heartbeat_s, args.stall_s)
                args.compiles.take()  # between turns (the other program's polls): not timed
                row.update(run_turn(engine, ids, args.decode_tokens, tick, watch, t))
                # Triton variants built inside the turn (each one is seconds of TTFT or decode)
                row["compiles"] = [(c["kernel"], c["seconds"]) for c in args.compiles.take()]
                if pressure is not None:
                    pressure.after_turn(t)
                memory_row(row, engine, args, pressure)
                if engine.memory is not None:
                    entry["memory_trace"] = engine.memory.trace.to_json()
                limits.add(row, engine, len(ids), args.chunk)
            got = row.pop("answer", None)
            history = ids + (got if "failed" not in row and got else answer)
            entry["turns"].append(row)
            print_row(name, row)
            save()
        if engine is not None and args.profile_top > 0:
            entry["decode_profile"] = profile_last(engine, ids, args, name)
            save()
    finally:
        if pressure is not None:
            pressure.close()
    return engine


def profile_last(engine: Engine, ids: list[int], args, name: str) -> dict:
    """One turn past the session (not in its figures): the last turn's prompt with its last
    chunk of tokens drawn afresh (its prefix cached: one long-context chunk to prefill), under
    cProfile. Where two engines' steps differ on the host, this says which functions differ."""
    rng = random.Random(args.seed + 7)
    keep = max(0, len(ids) - args.chunk)
    ids = ids[:keep] + [rng.randrange(3, args.vocab) for _ in range(len(ids) - keep)]
    pre, dec = cProfile.Profile(), cProfile.Profile()
    row = run_turn(engine, ids, args.decode_tokens, profile=dec, prefill_profile=pre)
    if "failed" in row:
        return {"failed": row["failed"]}
    keys = ("prefilled_tokens", "ttft_s", "step_ms", "step_p50_ms", "step_max_ms", "gc_ms")
    out = {"context": len(ids), **{k: row.get(k) for k in (*keys, "safe_point_ms")}}
    out["decode_top"] = host_profile(dec, max(1, row["decoded"] - 1), args.profile_top)
    out["prefill_top"] = host_profile(pre, 1, args.profile_top)
    print(
        f"prof {name:<11} ttft {row['ttft_s']:.3f} s ({row['prefilled_tokens']} tokens), "
        f"decode step {row['step_ms']:.2f} ms (p50 {row['step_p50_ms']:.2f})"
    )
    for what in ("decode", "prefill"):
        unit = "us/step" if what == "decode" else "us"
        for r in out[f"{what}_top"][:10]:
            print(f"prof {name:<11} {what:<8}{r['own_us_per_step']:9.0f} {unit:<8}"
                  f"{r['calls_per_step']:8.1f}x  {r['function']}")  # fmt: skip
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="freetoken bench elastic",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_knobs(parser, KNOBS)
    parser.add_argument(
        "--shape",
        default="qwen3-30b-a3b",
        choices=("qwen3-30b-a3b", "qwen3.6-35b-a3b"),
        help="model shape: Qwen3-30B-A3B (48 attention layers) or Qwen3.6-35B-A3B "
        "(40 layers, every 4th full attention: a quarter of the KV per token)",
    )
    parser.add_argument("--layers", type=int, default=None,
                        help="model depth (default: the shape's; cut: quicker)")  # fmt: skip
    parser.add_argument("--budget-gb", type=float, default=32.0, help="GPU budget (GB)")
    text = "what the other program takes (GB; --cpu-smoke: a quarter of the arena)"
    parser.add_argument("--pressure-gb", type=float, default=8.0, help=text)
    text = "how long the other program retries refused pieces (s; --cpu-smoke: polls x 0.05)"
    parser.add_argument("--pressure-timeout-s", type=float, default=15.0, help=text)
    text = "free memory the ballast leaves beside the engine's reserve (GB; --cpu-smoke: 1/16 "
    parser.add_argument("--headroom-gb", type=float, default=0.5, help=text + "of the arena)")
    text = "decode routing: native (the random router), uniform or zipf:S,loc:P (routing_traces)"
    parser.add_argument("--routing", default="native", help=text)
    parser.add_argument("--policy", default="adaptive", help="expert placement policy (device)")
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES,
                        help="engines to run, in order")  # fmt: skip
    text = "elastic counts as at least as fast as a fixed split within this fraction (noise)"
    parser.add_argument("--noise", type=float, default=0.03, help=text)
    parser.add_argument("--seed", type=int, default=0, help="session and weight seed")
    parser.add_argument("--cpu-smoke", action="store_true", help="CPU, tiny model, 4 short turns")
    parser.add_argument("--triton-cache", choices=("fresh", "shared"), default="fresh",
                        help="fresh (default): compile into a new Triton cache directory, so "
                        "engines measured in separate commands, or after other runs on the same "
                        "machine, pay the same compiles (a warm cache once hid 1-2 s compiles "
                        "inside a fixed split's turns); shared: the usual cache")  # fmt: skip
    parser.add_argument(
        "--heartbeat-s",
        type=float,
        default=10.0,
        help="a progress line on stderr every this many seconds of a turn",
    )
    parser.add_argument(
        "--stall-s",
        type=float,
        default=120.0,
        help="after this many seconds in one turn, dump every thread's stack "
        "(repeated; 0: never): evidence from a turn that does not end",
    )
    parser.add_argument(
        "--profile-top",
        type=int,
        default=25,
        help="after the session, one more turn on its whole history, decode under cProfile: "
        "the top functions by own time per step go to the JSON (0: no such turn)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "elastic_memory.json", help="JSON")
    parser.add_argument("--merge", type=Path, nargs="+", default=None, metavar="JSON",
                        help="no run: join reports of the same session made by separate runs "
                        "(--engines split across device commands) into --out, with the summary "
                        "and the PNG")  # fmt: skip
    args = parser.parse_args(argv)
    resolve_knobs(args, KNOBS)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.merge:
        return merge(args)
    on_gpu = torch.cuda.is_available() and not args.cpu_smoke
    if not on_gpu and not args.cpu_smoke:
        return print("no CUDA device: run with --cpu-smoke for the CPU flow") or 2
    if on_gpu and args.triton_cache == "fresh":  # read by Triton at each compile
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="freetoken-triton-")
    max_len = args.end_tokens + args.decode_tokens + 16
    if args.routing != "native":
        Regime.parse(args.routing)  # a typo fails here, not after the first engine
    cfg, args.stream_min = shape_config(args)
    if args.cpu_smoke:
        args.cfg = {**cfg, "max_position_embeddings": max(4096, max_len)}
        args.budget, arena = smoke_budget(args.cfg, args)
        # The toy arena's scale: the other program asks a quarter of it; the engine keeps an
        # eighth free; the ballast leaves a sixteenth beside that.
        args.pressure_bytes, args.smoke_reserve, args.headroom = arena // 4, arena // 8, arena // 16
        args.smoke_group = arena // 16
    else:
        args.cfg = {**cfg, "max_position_embeddings": max(cfg["max_position_embeddings"], max_len)}
        args.budget = int(args.budget_gb * 1e9)
        args.pressure_bytes = int(args.pressure_gb * 1e9)
        args.headroom = int(args.headroom_gb * 1e9)
    args.vocab = args.cfg["vocab_size"]
    args.pool = None  # the host experts, shared by the engines (build)
    args.compiles = CompileLog(sys.stderr)  # Triton compiles, printed and attached to turns
    turns = session(args)
    limits = Limits(args.cfg, on_gpu)
    where = torch.cuda.get_device_name() if on_gpu else "cpu"
    report = {
        "bench": "elastic",
        "device": where,
        "title": f"elastic split, {args.cfg['num_hidden_layers']} layers, "
        f"{args.budget / 1e9:.3g} GB budget ({where})",
        "args": {
            k: str(v) if isinstance(v, Path) else v
            for k, v in vars(args).items()
            if k not in ("cfg", "pool", "compiles")
        },  # fmt: skip
        "model": args.cfg,
        "limits": limits.to_json(),
        "contexts": [c for c, _, _ in turns],
        "engines": {},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after every turn: a run cut short keeps what it measured
        args.out.write_text(json.dumps(report, indent=1))

    print(HEAD, flush=True)
    for name in args.engines:
        entry = report["engines"][name] = {"turns": []}
        engine = run_engine(args, name, turns, limits, entry, save)
        if engine is not None:
            entry["stats"] = {k: engine.stats()[k] for k in ("memory", "experts", "elastic")}
            if "memory_trace" in entry and name == "elastic":
                report["memory_trace"] = entry.pop("memory_trace")
                report["turns_tok_s"] = [(r["step"], r["decode_tok_s"]) for r in entry["turns"]
                                         if r.get("decode_tok_s") and "step" in r]  # fmt: skip
        save()
        del engine  # a fresh engine each: free this one's memory first
        gc.collect()
        if on_gpu:
            torch.cuda.empty_cache()
    args.compiles.close()
    report["summary"] = summary = summarize(report, args)
    save()
    print(json.dumps(summary, indent=1))
    if "memory_trace" in report:
        plot(report, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
