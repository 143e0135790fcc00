"""Paged attention over three KV layouts at long contexts, on CUDA.

    python -m freetoken_agent.bench kv-layout [--contexts 2048 16384 44000 100000] [--out F]

- dense: the fixed pool's [L, P, S, Hkv, D] tensor, a layer's pages one dense block;
- interleaved: the elastic arena's first layout, a page holding every layer's K and V, so one
  layer's pages sit 2 * L * S * Hkv * D elements apart (1.57 MB for the Qwen3-30B shape): a
  layer's attention over 100k tokens touches ~6,000 separate 2 MB translation pages instead
  of ~100;
- arena: the elastic arena now (engine/arena.py): a lane of CUDA virtual memory per layer and
  K/V, mapped in 2 MB chunks.
On the device (bench/results/NOTES.md, issue 6) the elastic engine's time to first token ran
0.7-1.5 s above a fixed split's from 44k tokens on, with the interleaved layout; this measures
the attention part alone, and whether the lanes match the dense pool.

Per context: equal K/V values in every layout, pages in allocator order (lowest first: the
order a fresh session gets), all L layers in a row as a step does. Decode: one query token per
layer; prefill: a --chunk token chunk at the end of the context. Reported: ms per step (L
layers) per layout, the KV bytes read / time beside the HBM copy bandwidth measured in the
same run, and each layout over dense.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from triton.testing import do_bench

from freetoken_agent.bench.limits import hbm_copy_bandwidth
from freetoken_agent.engine.arena import ElasticArena, KVUnit
from freetoken_agent.help_format import DefaultsHelpFormatter
from freetoken_agent.kernels.triton.paged_attention import launch_paged_attention

# Qwen3-30B-A3B: L attention layers, Hq / Hkv heads, D head dim, S tokens per page
L, HQ, HKV, D, S = 48, 32, 4, 128, 16
DTYPE = torch.bfloat16


def layouts(n_pages: int, seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(k, v) as [L, P, S, Hkv, D] in every layout, equal values."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    shape = (L, n_pages, S, HKV, D)
    k = torch.randn(shape, generator=g, device="cuda", dtype=DTYPE)
    v = torch.randn(shape, generator=g, device="cuda", dtype=DTYPE)
    page = S * HKV * D  # elements of one page of one layer's K
    flat = torch.empty(n_pages * 2 * L * page, device="cuda", dtype=DTYPE)
    stride = (page, 2 * L * page, HKV * D, D, 1)  # a page: K of every layer, then V
    ki, vi = flat.as_strided(shape, stride, 0), flat.as_strided(shape, stride, L * page)
    unit = KVUnit(L, S, HKV, D, DTYPE)
    arena = ElasticArena(n_pages * unit.nbytes, "cuda", unit)
    for dst_k, dst_v in ((ki, vi), (arena.k[:, :n_pages], arena.v[:, :n_pages])):
        dst_k.copy_(k)
        dst_v.copy_(v)
    return {"dense": (k, v), "interleaved": (ki, vi), "arena": (arena.k, arena.v)}


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
                                formatter_class=DefaultsHelpFormatter)  # fmt: skip
    p.add_argument("--contexts", type=int, nargs="+", default=[2048, 16384, 44000, 100000],
                   help="context lengths (tokens)")  # fmt: skip
    p.add_argument("--chunk", type=int, default=8192, help="prefill chunk (tokens)")
    p.add_argument("--seed", type=int, default=0, help="random inputs' seed")
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
            for name in ("dense", "interleaved", "arena"):
                ms = step_ms(*kv[name], context, q_len, args.seed)
                row[f"{name}_ms"] = ms
                row[f"{name}_kv_gb_s"] = kv_bytes / ms / 1e6
                row[f"{name}_over_dense"] = ms / row["dense_ms"]
            row["hbm_gb_s"] = hbm / 1e9
            rows.append(row)
            print(f"{mode:<8} ctx {context:>7}  " + "  ".join(
                f"{n} {row[n + '_ms']:8.2f} ms (x{row[n + '_over_dense']:.3f}, "
                f"{row[n + '_kv_gb_s']:5.0f} GB/s)" for n in ("dense", "interleaved", "arena")
            ) + f"  copy {hbm / 1e9:.0f} GB/s", flush=True)  # fmt: skip
        del kv
        torch.cuda.empty_cache()
    if args.out is not None:
        args.out.write_text(json.dumps({"bench": "kv-layout", "rows": rows}, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
