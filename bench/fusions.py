"""The decode step's fused kernels, each on and off, in one all-resident engine beside the HBM
limit: EngineConfig.fused_router (kernels/triton/route.py) and fused_proj_norm
(kernels/triton/proj_norm.py); with both, the attention front in one launch
(EngineConfig.fused_norm_qkv, kernels/triton/norm_qkv.py: the `all+...` variants), the whole
attention block in one launch (EngineConfig.attention_block, kernels/triton/
attention_block.py: the `block+...` variants),
programmatic dependent launch (kernels/triton/pdl.py, FREETOKEN_PDL: on, exit, prefetch,
light), the skinny matmul for the other projections (EngineConfig.skinny_gemv) and o_proj's L2
prefetch (EngineConfig.l2_prefetch).

    python -m freetoken_agent.bench fusions [--layers 48] [--tokens 128] [--rounds 2]

One engine (the Qwen3-30B-A3B shape, random weights, all experts resident) is built once; for
each variant (none, router, proj_norm, both) the model's switches are set and the decode graphs
captured again, then decode tok/s at batch 1 and 4 (overlap scheduling on, as the engine runs).
Variants take turns over `--rounds` rounds (the device host's speed drifts over seconds); the
median round is reported beside the limit of `bench decode` (bytes a step must read / B_HBM).
JSON: `fusions_{layers}l_p{prompt}_m{max_model_len}.json`.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path

import torch

from freetoken_agent.bench.decode_baseline import decode_bytes, decode_rate
from freetoken_agent.bench.limits import hbm_copy_bandwidth
from freetoken_agent.bench.random_model import QWEN3_30B_A3B, peer_slice, random_engine
from freetoken_agent.engine.l2_prefetcher import use_l2_prefetch
from freetoken_agent.engine.layers.linear import use_skinny_gemv
from freetoken_agent.engine.layers.moe import use_fused_router
from freetoken_agent.engine.models.base import (
    use_attention_block,
    use_fused_norm_qkv,
    use_fused_proj_norm,
)
from freetoken_agent.help_format import DefaultsHelpFormatter
from freetoken_agent.kernels.triton import pdl

RESULTS = Path(__file__).resolve().parent / "results"
VARIANTS = {
    "none": (False, False, "off", False, False, False),
    "router": (True, False, "off", False, False, False),
    "proj_norm": (False, True, "off", False, False, False),
    "both": (True, True, "off", False, False, False),
    "both+pdl": (True, True, "on", False, False, False),
    "both+pdl-exit": (True, True, "exit", False, False, False),
    "both+pdl-light": (True, True, "light", False, False, False),
    "both+pdl-prefetch": (True, True, "on,prefetch", False, False, False),
    "both+skinny": (True, True, "off", True, False, False),
    "both+skinny+pdl-prefetch": (True, True, "on,prefetch", True, False, False),
    "both+l2": (True, True, "off", False, True, False),
    "all+pdl-light": (True, True, "light", False, False, True),
    "all+pdl": (True, True, "on", False, False, True),
    "all+pdl-prefetch": (True, True, "on,prefetch", False, False, True),
    "block+pdl-light": (True, True, "light", False, False, "block"),
    "block+pdl": (True, True, "on", False, False, "block"),
}  # name -> (fused_router, fused_proj_norm, FREETOKEN_PDL, skinny_gemv, l2_prefetch,
#             fused_norm_qkv, or "block": the attention block in one launch instead)


def set_variant(engine, name: str) -> None:
    """Switch the model's fusions, skinny matmuls and L2 prefetch to `name`'s and capture the
    decode graphs with them (call it inside `pdl.override(VARIANTS[name][2])`, which decoding
    needs too)."""
    router, proj_norm, _, skinny, l2, norm_qkv = VARIANTS[name]
    use_fused_router(engine.loaded.model, router)
    use_fused_proj_norm(engine.loaded.model, proj_norm)
    use_fused_norm_qkv(engine.loaded.model, norm_qkv is True)
    use_attention_block(engine.loaded.model, norm_qkv == "block")
    use_skinny_gemv(engine.loaded.model, skinny)
    use_l2_prefetch(engine.loaded.model, engine.loaded.bank, engine.loaded.device, l2)
    engine.capture_graphs()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="freetoken bench fusions",
        description=__doc__,
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument("--layers", type=int, default=48, help="model depth (12: peer slice)")
    parser.add_argument("--prompt", type=int, default=256, help="prompt tokens per request")
    parser.add_argument("--tokens", type=int, default=128, help="decoded tokens per request")
    parser.add_argument("--rounds", type=int, default=2, help="turns of every variant")
    parser.add_argument(
        "--max-model-len", type=int, default=0, metavar="TOKENS",
        help="the engine's max_model_len, the bound its decode graphs plan attention for "
        "(0: 4096, or the prompt and the decoded tokens if longer)",
    )  # fmt: skip
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                        help="which fusions to measure")  # fmt: skip
    parser.add_argument("--out", type=Path, default=RESULTS, help="JSON results folder")
    args = parser.parse_args(argv)
    needed = args.prompt + args.tokens + 64
    max_len = args.max_model_len or max(4096, needed)
    if max_len < needed:
        parser.error(f"--max-model-len {max_len} is shorter than --prompt plus --tokens plus "
                     "a 64-token margin")  # fmt: skip
    if not torch.cuda.is_available():
        parser.error("this benchmark needs CUDA")
    b_hbm = hbm_copy_bandwidth(torch.device("cuda"))
    engine = random_engine(peer_slice(QWEN3_30B_A3B, args.layers), max_num_seqs=8,
                           max_model_len=max_len, max_batched_tokens=2048)  # fmt: skip
    rng = random.Random(0)
    ctx = args.prompt + args.tokens // 2
    limits = {b: b / (decode_bytes(engine, b, ctx) / b_hbm) for b in (1, 4)}
    rates: dict[str, dict[int, list[float]]] = {v: {1: [], 4: []} for v in args.variants}
    for r in range(args.rounds):
        order = args.variants[r % len(args.variants) :] + args.variants[: r % len(args.variants)]
        for name in order:
            with pdl.override(VARIANTS[name][2]):
                set_variant(engine, name)
                decode_rate(engine, 1, 32, 16, rng)  # the new graphs' first replays
                for batch in (1, 4):
                    rate = decode_rate(engine, batch, args.prompt, args.tokens, rng)
                    rates[name][batch].append(rate)
    report = {"bench": "fusions", "layers": args.layers, "hbm_copy_gb_s": b_hbm / 1e9,
              "rounds": args.rounds, "prompt": args.prompt, "tokens": args.tokens,
              "max_model_len": max_len, "rows": {}}  # fmt: skip
    for name in args.variants:
        for batch in (1, 4):
            tok_s = statistics.median(rates[name][batch])
            row = {"tok_s": tok_s, "limit_tok_s": limits[batch],
                   "of_limit": tok_s / limits[batch], "rounds": rates[name][batch]}  # fmt: skip
            report["rows"][f"{name}|b{batch}"] = row
            print(f"{name}|b{batch}", json.dumps(row), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    # Runs at another prompt or bound do not overwrite each other.
    path = args.out / f"fusions_{args.layers}l_p{args.prompt}_m{max_len}.json"
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
