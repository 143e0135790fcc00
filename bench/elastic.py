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
miss bytes at B_P + B_H capped by the host read bandwidth, measured in this run), TTFT beside
its limit (each streamed chunk's bytes not resident at B_P: limits.streamed_prefill_floor_s;
none for a prefill too short to stream), reuse, slots, KV pages, decode
miss rate, preemptions, failure.
Summary: elastic >= both fixed splits on every turn (within --noise; a failed fixed turn is
slower), elastic never failed, its last-turn decode within 12% of its first. The JSON (--out) is
rewritten after every turn, with the elastic memory trace; a PNG goes beside it (without
matplotlib a notice: `python -m freetoken_agent.bench.memory_plot OUT.json OUT.png --x step`).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import tempfile
from pathlib import Path

import torch

from freetoken_agent.bench.compile_log import CompileLog
from freetoken_agent.bench.elastic_engines import shape_config, smoke_budget
from freetoken_agent.bench.elastic_report import ENGINES, merge, plot, summarize
from freetoken_agent.bench.elastic_rows import HEAD, Limits
from freetoken_agent.bench.elastic_session import run_engine, run_interleaved
from freetoken_agent.bench.environment import ENVIRONMENT
from freetoken_agent.bench.knobs import add_knobs, resolve_knobs
from freetoken_agent.bench.routing_traces import Regime
from freetoken_agent.help_format import DefaultsHelpFormatter

RESULTS = Path(__file__).resolve().parent / "results"

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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="freetoken bench elastic",
        description=__doc__,
        epilog=ENVIRONMENT,
        formatter_class=DefaultsHelpFormatter,
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
    parser.add_argument("--hybrid-run-ahead", action="store_true",
                        help="hybrid shapes: segmented decode runs ahead, re-running from "
                        "step-start copies of the recurrent state (hybrid_run_ahead)",
                        )  # fmt: skip
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES,
                        help="engines to run, in order")  # fmt: skip
    text = "elastic counts as at least as fast as a fixed split within this fraction (noise)"
    parser.add_argument("--noise", type=float, default=0.03, help=text)
    parser.add_argument("--seed", type=int, default=0, help="session and weight seed")
    parser.add_argument("--cpu-smoke", action="store_true", help="CPU, tiny model, 4 short turns")
    parser.add_argument("--triton-cache", choices=("fresh", "shared"), default="fresh",
                        help="fresh: compile into a new Triton cache directory, so "
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
        "--interleave",
        action="store_true",
        help="every engine alive at once, each turn prefilled on all of them (order "
        "alternating) and decoded in alternating blocks (--interleave-block): the machine's "
        "drift falls on all alike (default: one engine after another, each with the device "
        "to itself)",
    )
    parser.add_argument(
        "--interleave-block",
        type=int,
        default=16,
        help="with --interleave: each turn's decode alternates between the engines in blocks "
        "of this many steps (the host's speed switches level for seconds at a time on the "
        "device; 0: each engine's decode whole, one after another)",
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


def _finish(report: dict, name: str, engine) -> None:
    """An engine's stats into its entry; the elastic engine's memory trace to the report."""
    entry = report["engines"][name]
    if engine is None:
        return
    entry["stats"] = {k: engine.stats()[k] for k in ("memory", "experts", "elastic")}
    if "memory_trace" in entry and name == "elastic":
        report["memory_trace"] = entry.pop("memory_trace")
        report["turns_tok_s"] = [(r["step"], r["decode_tok_s"]) for r in entry["turns"]
                                 if r.get("decode_tok_s") and "step" in r]  # fmt: skip


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
    if args.interleave:  # every engine alive, turn by turn (elastic_session.py says why)
        engines = run_interleaved(args, args.engines, turns, limits, report, save)
        for name, engine in engines.items():
            _finish(report, name, engine)
        save()
    for name in [] if args.interleave else args.engines:
        entry = report["engines"][name] = {"turns": []}
        engine = run_engine(args, name, turns, limits, entry, save)
        _finish(report, name, engine)
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
