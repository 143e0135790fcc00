"""Agent sessions replayed against the engine: what each recurrent-checkpoint mode re-prefills.

    python -m freetoken_agent.bench agent [--kind coding] [--turns 20] [--budget-gb 32]
    python -m freetoken_agent.bench agent --cpu-smoke        # CI: a tiny model, 4 short turns

A session from agent_trace.py (tool schemas, reasoning, tool calls and outputs, user messages;
edits: reasoning stripped, tool output truncated, interrupted turn) is replayed turn by turn on
a Qwen3.6-35B-A3B-shaped hybrid model (random bf16 weights, 30 gated-DeltaNet and 10 attention
layers, experts offloaded under --budget-gb), once per checkpoint mode: anchors (the recurrent
state is checkpointed at the prompt's semantic anchors, the prompt's end and before decoded
marker tokens), positional:N (every N tokens) and none. Each mode gets a fresh engine: the mode
is an EngineConfig field, and a fresh engine starts from an empty prefix cache and checkpoint
pool; the weights are redrawn from the same seed, so every mode runs the same model.

A turn submits its rendered request with its anchors and decodes --decode-tokens tokens (the
random model's, for timing). The trace scripts what the model wrote (reasoning, a tool call)
and the next request carries that, so after each turn the runner prefills prompt + scripted
answer (all but its last token, which a model never feeds back) as a separate request,
checkpointed where decoding would have been (the prompt's anchors, before each marker token):
the cache then holds what a real turn leaves behind. That fill is reported apart and never
counted in a turn; on a hybrid model in mode none nothing is reused, so it is skipped there.

Per turn: tokens reused and re-prefilled (the engine's counts) beside the count the engine's
documented checkpoint rules predict (`expected_prefill`, from everything this run sent), time to
first token beside its limit (`ttft_reference_s`: the time a fresh --probe-tokens prompt took
in the same engine, scaled to the tokens re-prefilled; on an offloaded engine, to the chunks
that stream, since a chunk streams every layer whatever its length), decode tok/s beside that
probe's single-turn rate.
Per mode: worst-turn TTFT and total re-prefilled tokens; across modes, for each edited turn,
whether anchors re-prefilled strictly fewer tokens than positional. The JSON is rewritten after
every turn, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import inspect
import json
import random
import time
from pathlib import Path

import torch

from freetoken_agent.bench.agent_report import (
    CacheModel,
    compare,
    print_comparison,
    print_header,
    print_row,
    print_summary,
    summarize,
)
from freetoken_agent.bench.agent_trace import KINDS, AgentTrace, SessionShape, generate_session
from freetoken_agent.bench.environment import ENVIRONMENT

# `compare` is imported from here by other code: keep it reachable under this module's name.
from freetoken_agent.bench.knobs import add_knobs, resolve_knobs
from freetoken_agent.bench.limits import streamed_chunks
from freetoken_agent.engine.config import ConfigError, EngineConfig
from freetoken_agent.engine.engine import Engine
from freetoken_agent.engine.models.registry import spec_from_config
from freetoken_agent.engine.outputs import GenerationOutput
from freetoken_agent.engine.sampling_params import SamplingParams
from freetoken_agent.help_format import DefaultsHelpFormatter

RESULTS = Path(__file__).resolve().parent / "results"
# Tokens before which decoding checkpoints in anchors mode (as the Session passes them).
MARKERS = ("<tool_call>", "</think>", "<|im_end|>")
_FULL_EVERY = 4  # Qwen3.6: every 4th layer is full attention, the others gated DeltaNet

# Qwen3.6-35B-A3B's text model: transformers' Qwen3_5MoeTextConfig defaults, with the published
# context length and RoPE base.
QWEN36_35B_A3B = {
    "model_type": "qwen3_5_moe_text",
    "vocab_size": 248320,
    "hidden_size": 2048,
    "num_hidden_layers": 40,
    "layer_types": [
        "full_attention" if (i + 1) % _FULL_EVERY == 0 else "linear_attention" for i in range(40)
    ],
    "full_attention_interval": _FULL_EVERY,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "num_experts": 256,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 262144,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10_000_000.0,
        "partial_rotary_factor": 0.25,
    },
    "attention_bias": False,
    "tie_word_embeddings": False,
    "dtype": "bfloat16",
}
# The same layout at toy size for --cpu-smoke (fp32; the demo tokenizer's 1024 ids).
TINY_HYBRID = {
    **QWEN36_35B_A3B,
    **dict(vocab_size=1024, hidden_size=64, num_hidden_layers=4, num_attention_heads=4),
    **dict(head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4),
    **dict(linear_key_head_dim=16, linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2),
    **dict(moe_intermediate_size=32, shared_expert_intermediate_size=32, dtype="float32"),
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "max_position_embeddings": 8192,
}


def device_config(layers: int) -> dict:
    """The device model cut to its first `layers` layers (a quick run keeps the 3:1 mix)."""
    return {
        **QWEN36_35B_A3B,
        "num_hidden_layers": layers,
        "layer_types": QWEN36_35B_A3B["layer_types"][:layers],
    }


@dataclasses.dataclass(slots=True)
class Support:
    """What the engine in this checkout accepts (the anchor API landed in steps)."""

    checkpoints: bool  # EngineConfig.checkpoints
    submit: frozenset[str]  # of "anchors", "anchor_tokens"

    @staticmethod
    def detect() -> Support:
        fields = {f.name for f in dataclasses.fields(EngineConfig)}
        params = set(inspect.signature(Engine.submit).parameters)
        return Support("checkpoints" in fields, frozenset({"anchors", "anchor_tokens"} & params))


def build_engine(args: argparse.Namespace, mode: str, support: Support) -> tuple[Engine, str]:
    """(engine, what it is) for one checkpoint mode."""
    options = {"checkpoints": mode} if support.checkpoints else {}
    common = dict(max_model_len=args.max_model_len, max_batched_tokens=args.chunk, **options)
    if args.cpu_smoke:
        try:
            spec_from_config(TINY_HYBRID)
        except ConfigError:  # no hybrid family in this checkout: the demo model (attention)
            from freetoken_agent.demo_model import ensure_demo_model

            path = ensure_demo_model()
            engine = Engine.load(path, device="cpu", policy="resident", progress=False, **common)
            return engine, f"demo model {path.name} (qwen3_moe, attention only)"
        from freetoken_agent.bench.random_model import random_engine

        engine = random_engine(TINY_HYBRID, device="cpu", std=0.1, policy="resident", **common)
        return engine, "tiny qwen3_5_moe_text (random, fp32)"
    budget = int(args.budget_gb * 1e9)
    if args.model is not None:
        engine = Engine.load(
            args.model, "cuda", None, budget, args.policy, progress=False, **common
        )
        return engine, str(args.model)
    from freetoken_agent.bench.random_model import random_engine

    cfg = device_config(args.layers)
    engine = random_engine(
        cfg,
        policy=args.policy,
        gpu_budget=budget,
        max_num_seqs=4,
        # 128 tokens of a 256-expert top-8 layer touch ~98% of its experts (1 - e^-4): from
        # there on, streaming the whole layer beats fetching experts one by one.
        stream_min_tokens=128,
        **common,
    )
    bank = engine.loaded.bank
    if hasattr(bank, "bandwidths"):  # the adaptive split starts from this host's bandwidths
        from freetoken_agent.engine.experts import calibration

        h, i = cfg["hidden_size"], cfg["moe_intermediate_size"]
        bank.bandwidths.pcie = calibration.measure_pcie(3 * h * i * 2)
        bank.bandwidths.cpu = calibration.measure_cpu(h, i, torch.bfloat16)
    return engine, f"Qwen3.6-35B-A3B shape, {args.layers} layers, random bf16"


def run(engine: Engine, ids: list[int], n_decode: int, **options) -> GenerationOutput:
    """One request to completion, alone in the engine; `options` go to submit."""
    sp = SamplingParams(max_tokens=n_decode, temperature=0, ignore_eos=True)
    rid = engine.submit(ids, sp, **options)
    while engine.has_unfinished():
        engine.step()
    out = engine._collect(rid)  # the result of a submitted request (as bench offload does)
    if out.finish_reason == "error":
        raise RuntimeError(f"a request of {len(ids)} tokens failed: {out.error}")
    return out


def probe(engine: Engine, n_tokens: int, n_decode: int, seed: int) -> dict:
    """Prefill rate of a fresh n_tokens prompt (after one warm-up of the same size, so kernels
    are compiled for its shapes) and the decode rate after it; the cache is emptied after."""
    rng = random.Random(seed)
    vocab = engine.spec.vocab_size
    warm = [rng.randrange(vocab) for _ in range(n_tokens)]
    run(engine, warm, 2)
    if engine.scheduler.recurrence is not None:
        # Compile the snapshot variants of the recurrent kernels too (a long chunk and a short
        # one taking checkpoints), so no turn of the trace pays for it.
        run(engine, warm[: n_tokens // 2], 2, anchors=[n_tokens // 4, n_tokens // 3])
        run(engine, warm[: n_tokens // 2] + warm[:300], 2, anchors=[n_tokens // 2 + 100])
    out = run(engine, [rng.randrange(vocab) for _ in range(n_tokens)], n_decode)
    engine.radix.reset()  # the trace starts from an empty cache (checkpoints go with pages)
    ttft = out.stats["ttft_s"]
    return {
        "tokens": n_tokens,
        "ttft_s": ttft,
        "prefill_tok_s": n_tokens / ttft,
        "decode_tok_s": out.stats["decode_tok_s"],
    }


def ttft_reference_s(engine: Engine, prefilled: int, probe: dict) -> float:
    """The probe's time for `prefilled` tokens. Where the engine streams experts (an offloaded
    bank), per streamed chunk (bench/limits.py `streamed_chunks`): a chunk moves every layer's
    experts whatever its length, so per token a 300-token re-prefill was rated at a twentieth
    of what its one chunk allows; a prefill too short to stream (it fills slots) and a resident
    engine's, per token at the probe's rate."""
    rate = probe["prefill_tok_s"]
    stream_min = getattr(engine.loaded.bank, "stream_min_tokens", None)
    if stream_min is None:
        return prefilled / rate
    chunk = engine.config.max_batched_tokens
    # The probe's prompt has no checkpoints to cut its chunks at: whole chunks (the most it
    # streams, so the least time a chunk); a turn's may be cut (the fewest it streams).
    per_probe = streamed_chunks(probe["tokens"], chunk, stream_min, cuts=False)
    cuts = engine.scheduler.recurrence is not None
    streamed = streamed_chunks(prefilled, chunk, stream_min, cuts)
    if not (per_probe and streamed):
        return prefilled / rate
    return streamed * probe["ttft_s"] / per_probe


def replay(engine: Engine, trace: AgentTrace, mode: str, args, support: Support, entry: dict, save):
    """Every turn of the trace, in order, into entry["turns"] (saved and printed after each)."""
    markers = trace_markers()
    hybrid = bool(getattr(engine.spec, "is_hybrid", False))
    passed = markers if "anchor_tokens" in support.submit else frozenset()
    model = CacheModel(mode if support.checkpoints else "anchors", hybrid, passed)
    rate = entry["probe"]
    print_header(mode, entry)
    for turn in trace.turns:
        options: dict = {}
        if "anchors" in support.submit:
            options["anchors"] = turn.anchors
        if "anchor_tokens" in support.submit:
            options["anchor_tokens"] = sorted(markers)
        expected = len(turn.prompt_ids) - model.resume(turn.prompt_ids)
        out = run(engine, turn.prompt_ids, args.decode_tokens, **options)
        model.add(turn.prompt_ids, options.get("anchors", []), out.token_ids)
        st = out.stats
        row = {
            "turn": turn.index,
            "edit": turn.edit,
            "prompt_tokens": st["prompt_tokens"],
            "reused_tokens": st["reused_tokens"],
            "prefilled_tokens": st["prefilled_tokens"],
            "resumed_tokens": st.get("resumed_tokens"),
            "expected_prefill": expected,
            "anchor_prefill": turn.anchor_prefill,  # the trace's bound: prompt anchors only
            "min_prefill": turn.min_prefill,  # attention only: every shared token reused
            "ttft_s": st["ttft_s"],
            "ttft_limit_s": ttft_reference_s(engine, st["prefilled_tokens"], rate),
            "decode_tok_s": st["decode_tok_s"],
            "preempted": st.get("preempted", 0),  # re-admissions (they re-prefill)
        }
        row["ttft_of_limit"] = row["ttft_limit_s"] / row["ttft_s"]
        single = rate["decode_tok_s"]
        row["decode_of_single_turn"] = (row["decode_tok_s"] or 0) / single if single else None
        if not (hybrid and mode == "none"):
            # The scripted answer into the cache, checkpointed where decoding would have been.
            fill = turn.prompt_ids + turn.generated_ids[:-1]
            n = len(turn.prompt_ids)
            marks = {n + i for i, t in enumerate(turn.generated_ids[:-1]) if t in markers}
            if "anchors" in support.submit:
                options["anchors"] = sorted(marks.union(turn.anchors))
            t0 = time.perf_counter()
            done = run(engine, fill, 1, **options)
            model.add(fill, options.get("anchors", []), done.token_ids)
            row["fill_prefilled"] = done.stats["prefilled_tokens"]
            row["fill_s"] = time.perf_counter() - t0
        entry["turns"].append(row)
        print_row(row)
        save()


def trace_markers() -> frozenset[int]:
    from freetoken_agent.bench.agent_trace import demo_tokenizer

    vocab = demo_tokenizer().backend.get_vocab()
    return frozenset(vocab[m] for m in MARKERS if m in vocab)


# (option, device default, --cpu-smoke default, help): integer knobs whose default depends on
# the run (a 20-turn 40k-token session on the device model, or a short one on a tiny model).
KNOBS = (
    ("--turns", 20, 4, "requests in the session"),
    ("--decode-tokens", 32, 4, "tokens decoded per turn (the random model's, for timing)"),
    ("--probe-tokens", 8192, 256, "prompt tokens of the prefill-rate probe"),
    ("--chunk", 8192, 512, "max_batched_tokens: tokens per step (the prefill chunk)"),
    ("--max-model-len", 65536, 4096, "the engine's context"),
    ("--positional", 1024, 256, "N of a bare 'positional' mode (checkpoint every N tokens)"),
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="freetoken bench agent",
        description=__doc__,
        epilog=ENVIRONMENT,
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument("--kind", choices=KINDS, default="coding", help="session kind")
    parser.add_argument("--seed", type=int, default=0, help="trace seed (same seed, same tokens)")
    parser.add_argument(
        "--modes",
        nargs="+",
        default=["anchors", "positional", "none"],
        help="checkpoint modes, run in order: anchors, positional, positional:N, none",
    )
    add_knobs(parser, KNOBS)
    parser.add_argument("--budget-gb", type=float, default=32.0, help="GPU budget in GB")
    parser.add_argument("--policy", default="adaptive", help="expert placement policy")
    parser.add_argument("--layers", type=int, default=40, help="device model depth (cut: quick)")
    parser.add_argument("--model", type=Path, help="load this model folder instead (CUDA)")
    parser.add_argument("--cpu-smoke", action="store_true", help="CPU, tiny model, short trace")
    parser.add_argument("--out", type=Path, default=RESULTS / "agent_trace.json", help="JSON")
    args = parser.parse_args(argv)
    resolve_knobs(args, KNOBS)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    modes = [f"positional:{args.positional}" if m == "positional" else m for m in args.modes]
    support = Support.detect()
    if not support.checkpoints or "anchors" not in support.submit:
        print("warning: this engine lacks checkpoints= or anchors=; modes run alike", flush=True)
    shape = SessionShape.small() if args.cpu_smoke else None
    trace = generate_session(args.kind, args.seed, args.turns, shape)
    print(trace.summary(), flush=True)
    on_gpu = torch.cuda.is_available() and not args.cpu_smoke
    report = {
        "bench": "agent",
        "device": torch.cuda.get_device_name() if on_gpu else "cpu",
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "support": {"checkpoints": support.checkpoints, "submit": sorted(support.submit)},
        "trace": trace.to_json(ids=False),
        "modes": {},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after every turn: a run cut short keeps what it measured
        args.out.write_text(json.dumps(report, indent=1))

    for mode in modes:
        t0 = time.perf_counter()
        engine, what = build_engine(args, mode, support)
        entry = report["modes"][mode] = {"engine": what, "build_s": time.perf_counter() - t0}
        entry["probe"] = probe(engine, args.probe_tokens, args.decode_tokens, args.seed)
        entry["turns"] = []
        replay(engine, trace, mode, args, support, entry, save)
        entry["summary"] = s = summarize(entry["turns"])
        stats = engine.stats()
        keep = ("memory", "tokens", "checkpoints")
        entry["engine_stats"] = {k: stats[k] for k in keep if stats.get(k) is not None}
        save()
        print_summary(s)
        del engine  # a fresh engine per mode: free this one's memory first
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    report["comparison"] = c = compare(report["modes"])
    save()
    if c is not None:
        print_comparison(c, modes)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
