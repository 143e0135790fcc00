"""Baseline: all-resident decode and prefill on one GPU, beside the HBM limit.

    python -m freetoken_agent.bench decode [--layers 48 12] [--tokens 256] [--out DIR]

For each model (Qwen3-30B-A3B shape, and its first 12 layers, the "peer slice"): batch-1 and
batch-4 decode tok/s (CUDA graphs, and batch 1 eager), prefill tok/s of a 512-token prompt.
The decode limit is the bytes one step must read (dense weights except the embedding table,
the distinct experts the step routes to, the KV of the context) over the measured HBM
bandwidth; prefill is bounded by max(weight bytes / B_HBM, FLOPs / matmul rate).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from freetoken_agent.bench.limits import hbm_copy_bandwidth, matmul_rate
from freetoken_agent.bench.random_model import QWEN3_30B_A3B, peer_slice, random_engine
from freetoken_agent.engine.engine import Engine
from freetoken_agent.engine.sampling_params import SamplingParams
from freetoken_agent.help_format import DefaultsHelpFormatter

RESULTS = Path(__file__).resolve().parent / "results"


def _prompt(n: int, vocab: int, rng: random.Random) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


# Qwen3's recommended sampling (thinking mode), for the --sampled rows.
SAMPLED = dict(temperature=0.6, top_p=0.95, top_k=20)


def decode_rate(
    engine: Engine, batch: int, prompt_len: int, n_tokens: int, rng, sampled: bool = False
) -> float:
    """Aggregate decode tok/s of `batch` requests generating n_tokens each (timed from the
    step after the last prefill to the end); greedy, or with SAMPLED's sampling."""
    options = SAMPLED if sampled else {"temperature": 0}
    sp = SamplingParams(max_tokens=n_tokens, ignore_eos=True, **options)
    vocab = engine.spec.vocab_size
    ids = [engine.submit(_prompt(prompt_len, vocab, rng), sp) for _ in range(batch)]
    # Prefill everything first, so the timed steps are pure decode.
    while any(not engine._requests[r].output_ids for r in ids):
        engine.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    # Tokens, not calls: under overlap scheduling the last call only reads the last step.
    decoded = sum(len(engine._requests[r].output_ids) - 1 for r in ids)
    for r in ids:
        engine._collect(r)
    return decoded / elapsed


def prefill_rate(engine: Engine, n: int, rng) -> float:
    sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    engine.generate(_prompt(n, engine.spec.vocab_size, rng), sp)  # warm-up at this size
    torch.cuda.synchronize()
    start = time.perf_counter()
    engine.generate(_prompt(n, engine.spec.vocab_size, rng), sp)
    torch.cuda.synchronize()
    return n / (time.perf_counter() - start)


def kv_bytes_per_token(engine: Engine) -> int:
    """Bytes of K and V one held token has in every attention layer: what a decode step reads
    of it (a hybrid model's recurrent layers hold a state per sequence instead, no KV)."""
    spec = engine.spec
    itemsize = torch.tensor([], dtype=engine.loaded.dtype).element_size()
    return 2 * len(spec.attention_layers) * spec.n_kv_heads * spec.head_dim * itemsize


def decode_bytes(engine: Engine, batch: int, context: int) -> int:
    """Bytes one decode step must read at least: dense weights (the embedding table is only
    gathered), the distinct experts of `batch` tokens under uniform routing, and the KV."""
    spec = engine.spec
    model = engine.loaded.model
    dense = engine.loaded.dense_bytes - model.embed_tokens.device_nbytes
    e, k = spec.n_experts, spec.top_k
    expected_distinct = e * (1 - (1 - k / e) ** batch)  # per layer, uniform routing
    experts = spec.n_moe_layers * expected_distinct * spec.expert_bytes
    kv = batch * context * kv_bytes_per_token(engine)
    return int(dense + experts + kv)


def bench_model(cfg: dict, label: str, args, b_hbm: float, flops: float) -> dict:
    rng = random.Random(0)
    engine = random_engine(cfg, max_num_seqs=8, max_model_len=4096, max_batched_tokens=2048,
                           skinny_gemv=args.skinny_gemv,
                           fused_router=args.fused_router,
                           fused_proj_norm=args.fused_proj_norm)  # fmt: skip
    spec = engine.spec
    decode_rate(engine, 1, 32, 16, rng)  # warm-up (autotuning, allocator)
    result = {"model": label, "layers": spec.n_layers, "expert_gb": engine.loaded.bank.nbytes / 1e9}
    result["dense_gb"] = engine.loaded.dense_bytes / 1e9
    for batch in (1, 4):
        ctx = args.prompt + args.tokens // 2
        limit = batch / (decode_bytes(engine, batch, ctx) / b_hbm)
        result[f"decode_b{batch}_limit_tok_s"] = limit
        for overlap in (False, True) if args.overlap else (False,):
            for sampled in (False, True) if args.sampled else (False,):
                engine.overlap.enabled = overlap
                rate = decode_rate(engine, batch, args.prompt, args.tokens, rng, sampled)
                tags = ("_sampled" if sampled else "") + ("_overlap" if overlap else "")
                result[f"decode_b{batch}{tags}_tok_s"] = rate
                result[f"decode_b{batch}{tags}_of_limit"] = rate / limit
        engine.overlap.enabled = False
    graphs, engine.runner.graphs = engine.runner.graphs, None  # the same engine, eager
    eager = decode_rate(engine, 1, args.prompt, 64, rng)
    # Its own limit: 64 tokens decoded, so half of them past the prompt on average.
    eager_limit = 1 / (decode_bytes(engine, 1, args.prompt + 32) / b_hbm)
    result.update(decode_b1_eager_tok_s=eager, decode_b1_eager_limit_tok_s=eager_limit,
                  decode_b1_eager_of_limit=eager / eager_limit)  # fmt: skip
    engine.runner.graphs = graphs
    rate = prefill_rate(engine, 512, rng)
    weight_bytes = engine.loaded.dense_bytes + engine.loaded.bank.nbytes
    # FLOPs: 2 per weight per token, over the weights each token uses (bf16: bytes / 2).
    active_params = (
        engine.loaded.dense_bytes + spec.n_moe_layers * spec.top_k * spec.expert_bytes
    ) / 2
    active = 2 * 512 * active_params
    limit = 512 / max(weight_bytes / b_hbm, active / flops)
    result.update(prefill_512_tok_s=rate, prefill_512_limit_tok_s=limit)
    del engine
    torch.cuda.empty_cache()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="freetoken bench decode",
        description=__doc__,
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument("--layers", type=int, nargs="+", default=[48, 12],
                        help="model depths (48: Qwen3-30B-A3B, 12: peer slice)")  # fmt: skip
    parser.add_argument("--prompt", type=int, default=256, help="prompt tokens per request")
    parser.add_argument("--tokens", type=int, default=128, help="decoded tokens per request")
    parser.add_argument("--skinny-gemv", action="store_true",
                        help="decode projections through the Triton skinny matmul (EngineConfig."
                        "skinny_gemv); writes decode_baseline_skinny.json")  # fmt: skip
    parser.add_argument("--fused-router", action=argparse.BooleanOptionalAction, default=True,
                        help="one-row decode steps' routers in one launch, linear layer and "
                        "top-k (EngineConfig.fused_router; --no-fused-router "
                        "writes decode_baseline_no_fused_router.json)")  # fmt: skip
    parser.add_argument("--fused-proj-norm", action=argparse.BooleanOptionalAction, default=True,
                        help="one-row decode steps' o_proj, residual add and norm in one launch "
                        "(EngineConfig.fused_proj_norm; --no-fused-proj-norm "
                        "writes decode_baseline_no_fused_proj_norm.json)")  # fmt: skip
    parser.add_argument("--overlap", action="store_true",
                        help="decode also with overlap scheduling (EngineConfig.overlap_schedule):"
                        " decode_b*_overlap_tok_s beside the plain loop's")  # fmt: skip
    parser.add_argument("--sampled", action="store_true",
                        help="decode also with Qwen3's recommended sampling (temperature 0.6, "
                        "top-p 0.95, top-k 20): decode_b*_sampled_tok_s")  # fmt: skip
    parser.add_argument("--out", type=Path, default=RESULTS, help="JSON results folder")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the decode baseline needs a CUDA device")
    dev = torch.device("cuda")
    b_hbm = hbm_copy_bandwidth(dev)
    flops = matmul_rate(dev)
    runs = []
    for n in args.layers:
        label = "qwen3-30b-a3b" if n == 48 else f"qwen3-30b-a3b-first{n}"
        runs.append(bench_model(peer_slice(QWEN3_30B_A3B, n), label, args, b_hbm, flops))
        print(json.dumps(runs[-1], indent=1), flush=True)
    report = {
        "bench": "decode_baseline",
        "device": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "policy": "resident",
        "skinny_gemv": args.skinny_gemv,
        "fused_router": args.fused_router,
        "fused_proj_norm": args.fused_proj_norm,
        "overlap": args.overlap,
        "sampled": SAMPLED if args.sampled else None,
        "dtype": "bfloat16",
        "hbm_copy_bandwidth_gb_s": b_hbm / 1e9,
        "bf16_matmul_tflop_s": flops / 1e12,
        "prompt_tokens": args.prompt,
        "decode_tokens": args.tokens,
        "routing": "random router on random weights (near-uniform)",
        "runs": runs,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    name = "decode_baseline" + "_skinny" * args.skinny_gemv
    name += "_no_fused_router" * (not args.fused_router)
    name += "_no_fused_proj_norm" * (not args.fused_proj_norm)
    name += ".json"
    path = args.out / name
    path.write_text(json.dumps(report, indent=1))
    print(f"{'model':28} {'b1 tok/s':>9} {'limit':>7} {'b4 tok/s':>9} {'limit':>7} "
          f"{'eager b1':>9} {'prefill512':>10} {'limit':>8}")  # fmt: skip
    for r in runs:
        print(
            f"{r['model']:28} {r['decode_b1_tok_s']:9.1f} {r['decode_b1_limit_tok_s']:7.0f} "
            f"{r['decode_b4_tok_s']:9.1f} {r['decode_b4_limit_tok_s']:7.0f} "
            f"{r['decode_b1_eager_tok_s']:9.1f} {r['prefill_512_tok_s']:10.0f} "
            f"{r['prefill_512_limit_tok_s']:8.0f}"
        )
        for tags in ("_overlap", "_sampled", "_sampled_overlap"):
            if f"decode_b1{tags}_tok_s" in r:
                print(f"{'  ' + tags[1:].replace('_', ', '):28} {r[f'decode_b1{tags}_tok_s']:9.1f} "
                      f"{'':7} {r[f'decode_b4{tags}_tok_s']:9.1f}")  # fmt: skip
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
