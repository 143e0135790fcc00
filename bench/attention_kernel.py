"""Paged attention kernel timings on CUDA, each beside a limit measured in the same run.

    python -m freetoken_agent.bench.attention_kernel [--no-sweep] [--page 16]

Decode (batch 1 and 4, kv 1k / 4k / 16k / 32k): KV bytes read / time, next to the HBM bandwidth
of a large device-to-device copy (read + write counted). Two timings: eager (triton.testing
.do_bench median, L2 flushed before each call, both kernel launches included) and per layer of
a CUDA graph that runs the decode on `layers` distinct caches (at least 256 MB in all, so the
50 MB L2 cannot hold them). Prefill (one 4k-token sequence, causal): TFLOP/s next to torch's
SDPA on contiguous K/V (the fused-kernel bar, K/V repeated per query head beforehand).
Shapes: Hq = 32, Hkv = 4, D = 128, bf16 (Qwen3-style GQA). Each row names its tiles and split
count ("default" = the launcher's choice); sweep rows are candidates for the tables in
kernels/triton/paged_attention.py. Split launches combine in their last programs, as the
engine's do (since the twenty-fourth session; before, the separate combine kernel ran).
"""

# Shape legend: B sequences, L kv length, Hq / Hkv heads, D head dim, P pages of S tokens.

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from freetoken_agent.bench.cuda_graph import captured
from freetoken_agent.bench.limits import hbm_copy_bandwidth
from freetoken_agent.help_format import DefaultsHelpFormatter
from freetoken_agent.kernels.triton.attention_plan import LaunchPlan, Tiles, plan_launch
from freetoken_agent.kernels.triton.paged_attention import launch_paged_attention, new_counters

HQ, HKV, D = 32, 4, 128
DEV = "cuda"
DTYPE = torch.bfloat16
RESULTS = Path(__file__).resolve().parent / "results"
GRAPH_BYTES = 256 << 20  # KV bytes per graph replay, 5x the H200's 50 MB L2
# (tiles, num_splits); None = the launcher's choice, "xF" = F times its split count. The
# twenty-fifth session's sweep: at b=1 from 4k tokens up, fewer and longer splits and 8 warps
# or 128-wide steps won (16k: 33 splits 27.8 us, 8 warps 24.7, 128-wide 26.4, against 29.0);
# 32-wide steps, 4 stages and twice the splits lost everywhere. Their combinations next.
DECODE_SWEEP = [
    (Tiles(16, 128, 4, 2), None),
    (Tiles(16, 64, 8, 3), None),
    (Tiles(16, 64, 8, 4), None),
    (Tiles(16, 128, 4, 3), None),
    (Tiles(16, 64, 8, 3), "x0.5"),
    (Tiles(16, 128, 4, 2), "x0.5"),
    (None, "x0.5"),
    (None, "x0.25"),
]
PREFILL_SWEEP = [
    Tiles(128, 128, 8, 2),
    Tiles(128, 32, 4, 3),
    Tiles(64, 64, 4, 3),
    Tiles(128, 64, 8, 4),
]


class Batch:
    """One layer's inputs: B sequences of q_len new tokens over kv_len tokens each."""

    def __init__(self, B: int, q_len: int, kv_len: int, page: int, seed: int) -> None:
        g = torch.Generator(device=DEV).manual_seed(seed)
        pages_per_seq = triton.cdiv(kv_len, page)
        P = B * pages_per_seq
        self.k_cache = torch.randn(P, page, HKV, D, generator=g, device=DEV, dtype=DTYPE)
        self.v_cache = torch.randn_like(self.k_cache)
        # Shuffled pages: a real pool hands out scattered pages, not one contiguous run.
        perm = torch.randperm(P, generator=g, device=DEV)
        self.page_table = perm.view(B, pages_per_seq).int()  # [B, max_pages]
        self.q = torch.randn(B * q_len, HQ, D, generator=g, device=DEV, dtype=DTYPE)
        self.out = torch.empty_like(self.q)
        self.cu_q_lens = torch.arange(B + 1, dtype=torch.int32, device=DEV) * q_len
        self.kv_lens = torch.full((B,), kv_len, dtype=torch.int32, device=DEV)
        # The engine's attention layers pass their own counters, so split launches combine
        # in their last programs (engine/layers/attention.py); timed the same way here.
        self.counters = new_counters(torch.device(DEV))
        self.q_len, self.kv_len = q_len, kv_len
        self.kv_bytes = 2 * B * kv_len * HKV * D * self.q.element_size()  # K and V, read once

    def run(self, tiles: Tiles | None = None, num_splits: int | None = None,
            bound: int | None = None) -> None:  # fmt: skip
        """`bound`: the max_kv_len the launch plans for (default: this batch's kv_len; a
        decode graph plans for its max_pages x page size, engine/cuda_graphs.py)."""
        launch_paged_attention(
            self.q, self.k_cache, self.v_cache, self.page_table, self.cu_q_lens, self.kv_lens,
            D**-0.5, self.q_len, 0, self.out, bound or self.kv_len, tiles=tiles,
            num_splits=num_splits, counters=self.counters,
        )  # fmt: skip

    def plan(self, tiles: Tiles | None, num_splits: int | None,
             bound: int | None = None) -> LaunchPlan:  # fmt: skip
        B = self.kv_lens.numel()
        return plan_launch(self.q.device, self.q.shape[0], B, HQ, HKV, D, self.q_len,
                           bound or self.kv_len, tiles, num_splits)  # fmt: skip


def graph_ms_per_layer(layers: list[Batch], tiles: Tiles | None, num_splits: int | None,
                       bound: int | None = None) -> float:  # fmt: skip
    step = lambda: [b.run(tiles, num_splits, bound) for b in layers]
    return do_bench(captured(step), return_mode="median") / len(layers)


def bench_decode(B: int, kv_len: int, page: int, hbm: float, sweep: bool,
                 graph_bound: int = 0) -> list[dict]:  # fmt: skip
    """`graph_bound` > kv_len adds a row planned as the engine's decode graphs plan: for a
    max_kv_len of `graph_bound` (more splits, most of them empty at this length). Returns
    the rows printed, each beside its limit (HBM copy bandwidth)."""
    rows = []
    probe = Batch(B, 1, kv_len, page, seed=0)
    layers = [probe] + [
        Batch(B, 1, kv_len, page, seed=i)
        for i in range(1, triton.cdiv(GRAPH_BYTES, probe.kv_bytes))
    ]
    default_splits = probe.plan(None, None).num_splits
    candidates = [(None, None)] + (DECODE_SWEEP if sweep else [])
    if graph_bound > kv_len:
        candidates.append((None, "graph"))
    for tiles, splits in candidates:
        bound = None
        if splits == "graph":  # the engine's decode graph: planned for graph_bound tokens
            bound, splits = graph_bound, None
        elif isinstance(splits, str):  # a multiple of the default split count
            splits = max(1, round(default_splits * float(splits[1:])))
        plan = probe.plan(tiles, splits, bound)
        name = f"{'default tiles' if tiles is None else tiles}, NS {splits or 'default'}"
        if bound:
            name += f", planned for {bound} tokens (a decode graph's bound)"
        try:
            eager = do_bench(lambda t=tiles, s=splits, b=bound: probe.run(t, s, b),
                             return_mode="median")  # fmt: skip
            graph = graph_ms_per_layer(layers, tiles, splits, bound)
        except Exception as e:  # a candidate may not compile (resources): report and go on
            print(f"  decode B={B} L={kv_len}: {name} failed: {type(e).__name__}: {e}"[:200])
            continue
        gbps = probe.kv_bytes / graph / 1e6
        print(
            f"  decode B={B} L={kv_len:<6} NS={plan.num_splits:<3} eager {eager * 1e3:7.1f} us  "
            f"graph {graph * 1e3:7.1f} us/layer  KV {probe.kv_bytes / 1e6:6.1f} MB  "
            f"{gbps:6.0f} GB/s = {100 * gbps / hbm:3.0f}% of copy  {name}"
        )
        rows.append({"batch": B, "kv_len": kv_len, "candidate": name,
                     "num_splits": plan.num_splits, "graph_us_per_layer": graph * 1e3,
                     "kv_gb_s": gbps, "limit_gb_s": hbm, "of_limit": gbps / hbm})  # fmt: skip
    del layers
    torch.cuda.empty_cache()
    return rows


def bench_prefill(n: int, page: int, hbm: float, sweep: bool) -> None:
    batch = Batch(1, n, n, page, seed=0)
    flops = 4 * HQ * D * n * (n + 1) / 2  # QK^T and PV, 2 * D each per causal (query, key) pair
    k = batch.k_cache[batch.page_table[0].long()].reshape(-1, HKV, D)[:n]  # contiguous copies
    v = batch.v_cache[batch.page_table[0].long()].reshape(-1, HKV, D)[:n]
    k, v = (t.transpose(0, 1).repeat_interleave(HQ // HKV, 0)[None] for t in (k, v))
    q = batch.q.transpose(0, 1)[None]  # [1, Hq, n, D]
    sdpa = do_bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                    return_mode="median")  # fmt: skip
    print(f"  prefill n={n}: torch SDPA (contiguous) {sdpa * 1e3:8.1f} us  "
          f"{flops / sdpa / 1e9:6.1f} TFLOP/s")  # fmt: skip
    for tiles in [None] + (PREFILL_SWEEP if sweep else []):
        plan = batch.plan(tiles, None)
        try:
            ms = do_bench(lambda t=tiles: batch.run(t), return_mode="median")
        except Exception as e:
            print(f"  prefill n={n}: {plan.tiles} failed: {type(e).__name__}: {e}"[:200])
            continue
        gbps = batch.kv_bytes / ms / 1e6
        print(
            f"  prefill n={n} NS={plan.num_splits} {ms * 1e3:8.1f} us  {flops / ms / 1e9:6.1f} "
            f"TFLOP/s = {100 * sdpa / ms:3.0f}% of SDPA speed  KV {gbps:5.0f} GB/s = "
            f"{100 * gbps / hbm:3.0f}% of copy  {'default ' if tiles is None else ''}{plan.tiles}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="freetoken bench attention-kernel",
        description=__doc__.splitlines()[0],
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument("--no-sweep", action="store_true", help="time the default tiles only")
    parser.add_argument("--page", type=int, default=16, help="tokens per KV page")
    parser.add_argument(
        "--graph-bound", type=int, default=32768, metavar="TOKENS",
        help="also time each decode planned as the engine's decode graphs plan it, for a "
        "max_kv_len of this many tokens (max_model_len; 0: no such rows)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=RESULTS,
                        help="folder of the JSON of the decode rows")  # fmt: skip
    args = parser.parse_args(argv)
    assert torch.cuda.is_available(), "this benchmark needs a CUDA device"
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    hbm = hbm_copy_bandwidth(torch.device(DEV)) / 1e9
    print(f"HBM copy {hbm:.0f} GB/s (read + write)   Hq={HQ} Hkv={HKV} D={D} bf16 page={args.page}")
    decode = [row for B in (1, 4) for kv_len in (1024, 4096, 16384, 32768)
              for row in bench_decode(B, kv_len, args.page, hbm, not args.no_sweep,
                                      args.graph_bound)]  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "attention_kernel.json"
    path.write_text(json.dumps({"bench": "attention-kernel", "device": torch.cuda.get_device_name(),
                                "hbm_copy_gb_s": hbm, "page": args.page, "decode": decode},
                               indent=1))  # fmt: skip
    print(f"wrote {path}")
    bench_prefill(4096, args.page, hbm, not args.no_sweep)

    return 0


if __name__ == "__main__":
    raise SystemExit(main())
