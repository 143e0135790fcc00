"""Paged attention over the elastic arena's KV layout against the fixed pool's, on CUDA.

    python -m freetoken_agent.bench kv-layout [--contexts 2048 16384 44000 100000] [--out F]

The question it answers: does the arena's layout cost attention time at long contexts? In the
fixed pool a layer's K (and V) pages are one dense [P, S, Hkv, D] tensor; in the arena
(engine/arena.py) a page holds every layer's K and V, so one layer's pages sit
2 * L * S * Hkv * D elements apart (1.57 MB for the Qwen3-30B shape): a layer's attention over
100k tokens touches ~6,000 separate 2 MB translation pages instead of ~100. On the device
(bench/results/NOTES.md, issue 6) the elastic engine's time to first token ran 0.7-1.5 s above
the fixed split's from 44k tokens on; this measures the attention part alone.

Per context: the same K/V values in both layouts (the arena's on CUDA virtual memory, as the
engine allocates it), pages in allocator order (lowest first: the order a fresh session gets),
all L layers in a row as a step does. Decode: one query token per layer; prefill: a --chunk
token chunk at the end of the context. Reported: ms per step (L layers) per layout, the KV
bytes read / time beside the HBM copy bandwidth measured in the same run, and arena / dense.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from triton.testing import do_bench

from freetoken_agent.bench.limits import hbm_copy_bandwidth
from freetoken_agent.engine.arena import ElasticArena, KVUnit
from freetoken_agent.kernels.triton.paged_attention import launch_paged_attention

# Qwen3-30B-A3B: L attention layers, Hq / Hkv heads, D head dim, S tokens per page
L, HQ, HKV, D, S = 48, 32, 4, 128, 16
DTYPE = torch.bfloat16


def layouts(n_pages: int, seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(k, v) as [L, P, S, Hkv, D] in both layouts, equal values."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    shape = (L, n_pages, S, HKV, D)
    k = torch.randn(shape, generator=g, device="cuda", dtype=DTYPE)
    v = torch.randn(shape, generator=g, device="cuda", dtype=DTYPE)
    unit = KVUnit(L, S, HKV, D, DTYPE)
    arena = ElasticArena(n_pages * unit.nbytes, "cuda", unit)
    arena.k[:, :n_pages].copy_(k)
    arena.v[:, :n_pages].copy_(v)
    return {"dense": (k, v), "arena": (arena.k, arena.v), "_arena": arena}


def step_ms(k: torch.Tensor, v: torch.Tensor, context: int, q_len: int, seed: int) -> float:
    """Median ms of L layers' attention: q_len new tokens at the end of `context`."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    pages = -(-context // S)
    table = torch.arange(pages, dtype=torch.int32, device="cuda")[None]  # [1, pages]
    q = torch.randn(q_len, HQ, D, generator=g, device="cuda", dtype=DTYPE)
    out = torch.empty_like(q)
    cu = torch.tensor([0, q_len], dtype=torch.int32, device="cuda")
    lens = torch.tensor([context], dtype=torch.int32, device="cuda")

    def step() -> None:
        for layer in range(L):
            launch_paged_attention(q, k[layer], v[layer], table, cu, lens, D**-0.5, q_len,
                                   0, out, context)  # fmt: skip

    return do_bench(step, return_mode="median")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="freetoken bench kv-layout", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--contexts", type=int, nargs="+", default=[2048, 16384, 44000, 100000])
    p.add_argument("--chunk", type=int, default=8192, help="prefill chunk (tokens)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="JSON results")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        return print("no CUDA device") or 2
    hbm = hbm_copy_bandwidth(torch.device("cuda"))
    rows = []
    print(f"HBM copy {hbm / 1e9:.0f} GB/s; L={L} Hq={HQ} Hkv={HKV} D={D} S={S} bf16")
    for context in args.contexts:
        kv = layouts(-(-context // S), args.seed)
        for mode, q_len in (("decode", 1), ("prefill", min(args.chunk, context))):
            row = {"context": context, "mode": mode, "q_len": q_len}
            kv_bytes = 2 * L * context * HKV * D * DTYPE.itemsize  # K and V, every layer
            for name in ("dense", "arena"):
                ms = step_ms(*kv[name], context, q_len, args.seed)
                row[f"{name}_ms"] = ms
                row[f"{name}_kv_gb_s"] = kv_bytes / ms / 1e6
            row["arena_over_dense"] = row["arena_ms"] / row["dense_ms"]
            row["hbm_gb_s"] = hbm / 1e9
            rows.append(row)
            print(f"{mode:<8} ctx {context:>7}  dense {row['dense_ms']:8.2f} ms  arena "
                  f"{row['arena_ms']:8.2f} ms  x{row['arena_over_dense']:.3f}  KV read "
                  f"{row['dense_kv_gb_s']:5.0f} / {row['arena_kv_gb_s']:5.0f} GB/s "
                  f"(copy {hbm / 1e9:.0f})", flush=True)  # fmt: skip
        del kv
        torch.cuda.empty_cache()
    if args.out is not None:
        args.out.write_text(json.dumps({"bench": "kv-layout", "rows": rows}, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
